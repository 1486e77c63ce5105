"""A Python program under `stagefs run` that opens a staged file and asks for its descriptor
(`os.fstat(f.fileno())`, `mmap.mmap(f.fileno(), ...)`, as `numpy.load(mmap_mode="r")`
does) reads the file once, from wherever it is held, and `stagefs status` counts it once:
one sample, its bytes once. The Python-level interception serves the open (its Store reads
and counts the file), and the descriptor must not make the preload library read and count
it again (its helper's Store, or a sample at the open of a tier's copy). The descriptor
stays a read-only one, every byte right, and `os.fstat` of it reports the manifest."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_preload import _env, plain, run

import stagefs
from conftest import random_bytes, text_bytes
from stagefs._native import preload_library
from stagefs.fileobj import WHOLE_READ_LIMIT

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(preload_library() is None,
                       reason="the preload library is not built (no C compiler at install)"),
]

LARGE = "npy/large.npy"  # read by range (more than WHOLE_READ_LIMIT): the library's own fd
SMALL = "npy/small.npy"  # read whole at open, as the other small files
TEXT = "notes.txt"  # stored compressed

# PROG MODE FILE...: for each file, a line of what the program saw through the descriptor
PROG = r"""
import errno, fcntl, hashlib, mmap, os, sys
mode, paths = sys.argv[1], sys.argv[2:]
for p in paths:
    with open(p, "rb") as f:
        fd = f.fileno()
        st = os.fstat(fd)
        acc = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
        try:
            os.write(fd, b"WRITTEN!")
            wrote = "done"
        except OSError as e:
            wrote = errno.errorcode[e.errno]
        try:
            mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            shared = "done"
        except OSError as e:
            shared = errno.errorcode[e.errno]
        sealed = "-"
        # the kernel's name of the file behind fd (/proc/self/fd/N names the staged file)
        proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
        if os.readlink(str(fd), dir_fd=proc).startswith("/memfd:"):  # its bytes sealed
            w = os.open(str(fd), os.O_RDWR, dir_fd=proc)
            try:
                os.pwrite(w, b"WRITTEN!", 0)
                sealed = "no"
            except OSError as e:
                sealed = errno.errorcode[e.errno]
            os.close(w)
        os.close(proc)
        if mode == "fstat":
            data = f.read()
        else:
            data = bytes(mmap.mmap(fd, 0, prot=mmap.PROT_READ))
    print(os.path.basename(p), hashlib.sha256(data).hexdigest(), st.st_size, oct(st.st_mode),
          st.st_mtime_ns, acc, wrote, shared, sealed in ("-", "EPERM"))
"""


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, bytes]]:
    base = tmp_path_factory.mktemp("fileno")
    rng = random.Random(18)
    files = {f"d/f{i:02d}": random_bytes(rng.randint(20_000, 150_000), 100 + i)
             for i in range(30)}
    files[TEXT] = text_bytes(200_000, 7)
    rows = np.random.default_rng(8)
    for rel, n in ((SMALL, 100_000), (LARGE, WHOLE_READ_LIMIT // 8 + 300_000)):
        buf = io.BytesIO()
        np.save(buf, rows.integers(0, 2**63, n))
        files[rel] = buf.getvalue()
    for rel, data in files.items():
        (base / "src" / rel).parent.mkdir(parents=True, exist_ok=True)
        (base / "src" / rel).write_bytes(data)
    stagefs.pack(str(base / "src"), str(base / "pack"), shard_size="1MiB", jobs=1,
                 progress=False, echo=lambda _m: None)
    with stagefs.open(base / "pack") as fs:
        assert fs.manifest.codec[fs.namespace.file_entry(TEXT)]
    return base / "src", base / "pack", files


def _status(rt: Path) -> dict[str, Any]:
    got = subprocess.run([sys.executable, "-m", "stagefs.cli", "status", "--runtime", str(rt),
                          "--json"], capture_output=True, text=True, timeout=120, env=_env(),
                         check=False)
    assert got.returncode == 0, got.stderr
    return json.loads(got.stdout)  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["fstat", "mmap"])
@pytest.mark.parametrize("holder", ["cold tier", "warm tier"])
def test_a_file_whose_descriptor_is_asked_for_is_read_and_counted_once(
        tree: tuple[Path, Path, dict[str, bytes]], tmp_path: Path, mode: str, holder: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """cold: the tier is empty when the program starts (the first epoch: the files come from
    the origin, while the streams place their shards); warm: every shard is staged."""
    _, pack, files = tree
    at, tier, rt = tmp_path / "data", tmp_path / "tier", tmp_path / "rt"
    if holder == "warm tier":
        subprocess.run([sys.executable, "-m", "stagefs.cli", "stage", str(pack), "--tier",
                        str(tier), "--runtime", str(rt), "--no-progress"], check=True,
                       env=_env(), capture_output=True, timeout=120)
    monkeypatch.setenv("STAGEFS_RUNTIME", str(rt))
    before = _status(rt) if holder == "warm tier" else {"reads": 0, "bytes": 0,
                                                        "fetched": {"bytes": 0}}
    # a mapping of a large file's tier copy is not a read the library counts bytes of (as
    # for any program's mmap): the large file is read with read() only
    names = sorted(rel for rel in files if mode == "fstat" or rel != LARGE)
    prog = tmp_path / "prog.py"
    prog.write_text(PROG)
    got = run(pack, at, sys.executable, prog, mode, *(at / rel for rel in names), tiers=[tier])
    after = _status(rt)

    want = []
    with stagefs.open(pack) as fs:
        for rel in names:
            st = fs.namespace.stat(rel)
            want.append(f"{os.path.basename(rel)} {hashlib.sha256(files[rel]).hexdigest()} "
                        f"{len(files[rel])} {oct(st.st_mode)} {st.st_mtime_ns} {os.O_RDONLY} "
                        "EBADF EACCES True")
    # every byte right, through a read-only descriptor that fstat says is the file
    assert got.stdout.decode().splitlines() == want, got.stderr.decode()

    total = sum(len(files[rel]) for rel in names)
    reads, nbytes = after["reads"] - before["reads"], after["bytes"] - before["bytes"]
    fetched = after["fetched"]["bytes"] - before["fetched"]["bytes"]
    assert (reads, nbytes) == (len(names), total), (after, got.stderr.decode())
    if holder == "warm tier":
        assert fetched == 0, after  # every file from the tier
    else:  # each byte of the origin's shards read at most once
        assert fetched <= sum(p.stat().st_size for p in pack.glob("*.sfs")), after


NPLOAD = r"""
import hashlib, os, sys, numpy as np
for p in sys.argv[1:]:
    a = np.load(p, mmap_mode="r")
    with open(p, "rb") as f:
        fd = f.fileno()
        print(os.path.basename(p), a.shape, hashlib.sha256(a.tobytes()).hexdigest(),
              os.readlink(str(fd), dir_fd=os.open("/proc/self/fd", os.O_RDONLY)).startswith(
                  "/memfd:"), os.fstat(fd).st_size)  # the kernel's name of its file
"""


def test_numpy_mmap_maps_a_large_file_s_own_pages(tree: tuple[Path, Path, dict[str, bytes]],
                                                  tmp_path: Path) -> None:
    """np.load(mmap_mode="r") and fileno(): a large file's descriptor is the library's on
    the file that holds it (its pages mapped, no in-memory copy: 0014); a small one's is
    the bytes its open read, in a sealed in-memory copy (not read a second time)."""
    src, pack, _ = tree
    at = tmp_path / "data"
    got = run(pack, at, sys.executable, "-c", NPLOAD, at / SMALL, at / LARGE).stdout
    want = plain(sys.executable, "-c", NPLOAD, src / SMALL, src / LARGE)
    lines = got.decode().splitlines()
    assert [line.split()[:-2] for line in lines] == \
        [line.split()[:-2] for line in want.decode().splitlines()]
    assert [line.split()[-2:] for line in lines] == [
        ["True", str(len(tree[2][SMALL]))], ["False", str(len(tree[2][LARGE]))]]
