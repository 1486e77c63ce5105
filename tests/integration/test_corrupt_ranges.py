"""A corrupt byte in a large raw file never reaches a program: FUSE and ``stagefs run``."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_fuse import _run, mounted

import stagefs
from stagefs.format import MANIFEST_NAME, Manifest
from stagefs.posix.fuse import fuse_available

pytestmark = pytest.mark.integration

MiB = 2**20
BIG = "big.bin"


@pytest.fixture(scope="module")
def corrupt_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pack whose 6 MiB raw file has one flipped byte in its fourth piece."""
    base = tmp_path_factory.mktemp("corrupt")
    (base / "src").mkdir()
    (base / "src" / BIG).write_bytes(b"\x89PNG" + bytes(range(256)) * (6 * 4096 + 11))
    (base / "src" / "ok.txt").write_bytes(b"fine\n")
    stagefs.pack(base / "src", base / "pack", jobs=1, progress=False, echo=lambda _m: None)
    m = Manifest(str(base / "pack" / MANIFEST_NAME))
    e = m.lookup(BIG.encode())
    assert m.codec[e] == 0
    shard, off = m.shards[m.shard[e]].name, int(m.offset[e])
    m.close()
    with open(base / "pack" / shard, "r+b") as f:
        f.seek(off + 3 * MiB + 7)
        b = f.read(1)
        f.seek(off + 3 * MiB + 7)
        f.write(bytes([b[0] ^ 1]))
    return base / "pack"


@pytest.fixture
def mnt(corrupt_pack: Path, tmp_path: Path) -> Iterator[Path]:
    if fuse_available() is not None:
        pytest.skip(str(fuse_available()))
    mp = tmp_path / "mnt"
    mp.mkdir()
    with mounted(corrupt_pack, mp):
        yield mp


def test_fuse_cat_of_the_corrupt_file_fails(mnt: Path) -> None:
    r = _run(["sh", "-c", f"cat '{mnt / BIG}' > /dev/null"])
    assert r.returncode != 0
    assert "Input/output error" in r.stderr
    assert _run(["cat", str(mnt / "ok.txt")]).stdout == "fine\n"
    # a range over intact pieces (the sixth MiB) still reads
    r = _run(["sh", "-c", f"dd if='{mnt / BIG}' bs=4096 skip=1280 count=2 status=none | wc -c"])
    assert r.returncode == 0 and r.stdout.strip() == "8192", r.stderr


def test_stagefs_run_read_of_the_corrupt_file_raises(corrupt_pack: Path, tmp_path: Path) -> None:
    at = tmp_path / "data"
    for code in (f"open({str(at / BIG)!r}, 'rb').read()",
                 f"f = open({str(at / BIG)!r}, 'rb'); f.seek(3 * 2**20); f.read(100)"):
        r = _run([sys.executable, "-m", "stagefs.cli", "run", "--dataset", str(corrupt_pack),
                  "--at", str(at), "--", sys.executable, "-c", code])
        assert r.returncode != 0, code
        assert "ChecksumError" in r.stderr and BIG in r.stderr
    code = f"f = open({str(at / BIG)!r}, 'rb'); f.seek(5 * 2**20); print(len(f.read(1000)))"
    r = _run([sys.executable, "-m", "stagefs.cli", "run", "--dataset", str(corrupt_pack),
              "--at", str(at), "--", sys.executable, "-c", code])
    assert r.returncode == 0 and r.stdout.strip() == "1000", r.stderr
