"""What reaches the ``stagefs mount`` server: its requests, counted from libfuse's own trace
(the server mounted with ``debug``), for a cold read and for warm reads."""

from __future__ import annotations

import errno
import os
import random
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import stagefs
from stagefs.posix.fuse import MAX_READ, fuse_available, is_mounted, unmount

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(fuse_available() is not None, reason=str(fuse_available())),
]

_SERVE = "import sys, stagefs; from stagefs.posix import fuse; " \
         "fuse.mount(stagefs.open(sys.argv[1]), sys.argv[2], debug=True)"
_OP = re.compile(rb"opcode: (\w+)")
_FORGETS = {"FORGET", "BATCH_FORGET"}  # the kernel letting go of inodes, no question asked


class Traced:
    """A mount whose server writes every request it gets to a log; ``mark(name)`` starts a
    new phase (a lookup of a missing name, the trace's only landmark), ``requests(name)``
    counts that phase's requests by opcode."""

    def __init__(self, log: Path, mp: Path) -> None:
        self.log, self.mp = log, mp

    def mark(self, name: str) -> None:
        assert not (self.mp / f".phase-{name}").exists()

    def requests(self, name: str) -> Counter[str]:
        text = self.log.read_bytes()
        start = text.index(f"LOOKUP /.phase-{name}".encode())
        start = text.index(b"\n", start)
        end = text.find(b"LOOKUP /.phase-", start)  # the next mark, from its request line
        part = text[start : text.rindex(b"unique:", start, end) if end >= 0 else len(text)]
        ops = Counter(m.decode() for m in _OP.findall(part))
        return Counter({k: n for k, n in ops.items() if k not in _FORGETS})


@pytest.fixture
def traced(tmp_path: Path) -> Iterator[tuple[Traced, dict[str, bytes]]]:
    rng = random.Random(5)
    files = {f"d/s{i:02d}.bin": rng.randbytes(rng.randint(20_000, 120_000)) for i in range(20)}
    files["d/big.bin"] = rng.randbytes(MAX_READ)
    for rel, data in files.items():
        (tmp_path / "raw" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "raw" / rel).write_bytes(data)
    stagefs.pack(tmp_path / "raw", tmp_path / "pack", jobs=1, progress=False,
                 echo=lambda _m: None)
    mp, log = tmp_path / "mnt", tmp_path / "server.log"
    mp.mkdir()
    with open(log, "wb") as out:
        server = subprocess.Popen([sys.executable, "-c", _SERVE, str(tmp_path / "pack"),
                                   str(mp)], stdout=out, stderr=out, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not is_mounted(str(mp)):
            assert server.poll() is None, log.read_text(errors="replace")[-2000:]
            assert time.monotonic() < deadline, "the mount did not come up"
            time.sleep(0.02)
        yield Traced(log, mp), files
    finally:
        if is_mounted(str(mp)):
            unmount(str(mp))
        server.wait(timeout=60)


def _read_fd(path: Path) -> bytes:
    """A whole file by os.open + os.read: no isatty probe, unlike a buffered open()."""
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while chunk := os.read(fd, MAX_READ + 1):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


@pytest.mark.skipif(os.geteuid() != 0,
                    reason="only root may raise a mount's read-ahead (/sys/class/bdi)")
def test_a_cold_large_file_is_one_read_request(traced: tuple[Traced, dict[str, bytes]]) -> None:
    t, files = traced
    t.mark("cold")
    assert _read_fd(t.mp / "d/big.bin") == files["d/big.bin"]
    # the kernel's default window (128 KiB) would ask for it in 8 requests, one by one
    assert t.requests("cold")["READ"] == 1


def test_warm_reads_reach_the_server_only_for_open_s_tty_probe(
        traced: tuple[Traced, dict[str, bytes]]) -> None:
    t, files = traced
    t.mark("cold")
    for rel, data in files.items():
        assert _read_fd(t.mp / rel) == data
    t.mark("warm-fd")
    for rel, data in files.items():
        assert _read_fd(t.mp / rel) == data
    t.mark("warm-open")
    for rel, data in files.items():
        with open(t.mp / rel, "rb") as f:
            assert f.read() == data
    t.mark("end")
    cold = t.requests("cold")
    assert cold["READ"] >= len(files) and cold["LOOKUP"] >= len(files)
    # warm: names, attributes and pages come from the kernel, and no_open spares the opens
    assert t.requests("warm-fd") == Counter()
    # a buffered open() (Python < 3.14) asks isatty(): an ioctl, which the kernel always
    # sends to a FUSE server (answered by libfuse, in C); nothing else
    probe = t.requests("warm-open")
    assert set(probe) <= {"IOCTL"} and probe["IOCTL"] <= len(files)


def test_a_listed_directory_s_files_open_and_stat_without_a_lookup(
        traced: tuple[Traced, dict[str, bytes]]) -> None:
    t, files = traced
    t.mark("list")
    listed = {e.name: e.inode() for e in os.scandir(t.mp / "d")}  # names only: no stat
    t.mark("cold")
    for rel, data in files.items():
        assert _read_fd(t.mp / rel) == data
        s = os.stat(t.mp / rel)
        assert (s.st_size, s.st_ino) == (len(data), listed[rel[2:]])
    t.mark("end")
    assert sorted(listed) == sorted(rel[2:] for rel in files)
    # READDIRPLUS carried every entry whole: the kernel asks no LOOKUP and no GETATTR
    cold = t.requests("cold")
    assert cold["READ"] >= len(files)
    assert cold["LOOKUP"] == 0 and cold["GETATTR"] == 0, cold
    assert t.requests("list")["READDIRPLUS"] >= 1


def test_a_long_listing_over_many_readdirplus_requests_is_whole(tmp_path: Path) -> None:
    names = [f"n{i:04d}-{'x' * (i % 40)}" for i in range(700)]
    for n in names:
        (tmp_path / "raw" / "big").mkdir(parents=True, exist_ok=True)
        (tmp_path / "raw" / "big" / n).write_bytes(n.encode())
    (tmp_path / "raw" / "big" / "sub").mkdir()
    stagefs.pack(tmp_path / "raw", tmp_path / "pack", jobs=1, progress=False,
                 echo=lambda _m: None)
    mp = tmp_path / "mnt"
    mp.mkdir()
    server = subprocess.Popen([sys.executable, "-c", _SERVE.replace("debug=True", "debug=False"),
                               str(tmp_path / "pack"), str(mp)], stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not is_mounted(str(mp)):
            assert server.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        got = subprocess.run(["ls", "-a", str(mp / "big")], capture_output=True, text=True,
                             check=True).stdout.split()
        assert sorted(got) == sorted([".", "..", "sub", *names])  # each once, none lost
        assert {n: (mp / "big" / n).read_bytes() for n in names[::50]} == {
            n: n.encode() for n in names[::50]}
        assert (mp / "big" / "sub").is_dir() and os.stat(mp / "big" / ".").st_ino == \
            os.stat(mp / "big").st_ino
    finally:
        if is_mounted(str(mp)):
            unmount(str(mp))
        server.wait(timeout=60)


_SERVE_TIER = "import sys, stagefs; from stagefs.posix import fuse; " \
    "fuse.mount(stagefs.open(sys.argv[1], tiers=[sys.argv[3]], runtime=sys.argv[4]), " \
    "sys.argv[2], debug=True)"


def _mount_tier(tmp_path: Path, files: dict[str, bytes], push: bool,
                corrupt: str | None = None, compress: str = "none"
                ) -> tuple[Traced, subprocess.Popen[bytes], Path]:
    """A traced mount of ``files`` (one shard) with a tier, pushing or not; ``corrupt``:
    a file whose bytes in the pack are flipped after packing."""
    for rel, data in files.items():
        (tmp_path / "raw" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "raw" / rel).write_bytes(data)
    pack = tmp_path / "pack"
    stagefs.pack(tmp_path / "raw", pack, jobs=1, progress=False, echo=lambda _m: None,
                 compress=compress)
    if corrupt is not None:
        from stagefs.format import MANIFEST_NAME, Manifest

        m = Manifest(str(pack / MANIFEST_NAME))
        e = m.lookup(corrupt.encode())
        shard = pack / m.shards[int(m.shard[e])].name
        at = int(m.offset[e]) + int(m.stored[e]) // 2
        m.close()
        with open(shard, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))
    mp, log, rt = tmp_path / "mnt", tmp_path / "server.log", tmp_path / "rt"
    mp.mkdir()
    env = {**os.environ, "STAGEFS_FUSE_PUSH": "1" if push else "0"}
    with open(log, "wb") as out:
        server = subprocess.Popen([sys.executable, "-c", _SERVE_TIER, str(pack), str(mp),
                                   str(tmp_path / "tier"), str(rt)], stdout=out, stderr=out,
                                  stdin=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 60
    while not is_mounted(str(mp)):
        assert server.poll() is None, log.read_text(errors="replace")[-2000:]
        assert time.monotonic() < deadline, "the mount did not come up"
        time.sleep(0.02)
    return Traced(log, mp), server, rt


def _counted(rt: Path) -> int:
    from stagefs.tiers.status import read_counts

    c = read_counts(str(rt / "stats"))
    return sum(c[f"{h}_reads"] for h in ("memory", "disk", "peer", "origin"))


def _wait(until: Any, what: str) -> None:
    deadline = time.monotonic() + 60
    while not until():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _small_files(seed: int) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {f"d/f{i:02d}.bin": rng.randbytes(rng.randint(3_000, 150_000)) for i in range(40)}


@pytest.mark.parametrize("push", [True, False])
def test_streamed_files_are_pushed_into_the_page_cache(tmp_path: Path, push: bool) -> None:
    """A program lists the directory and reads one file: the stream then brings the rest
    of the shard, and (pushing, the default) each file goes into the kernel's page cache,
    so reading the others asks this server for nothing; every byte is right and each
    sample is counted once. Without the push, each of them is a READ."""
    from stagefs.runtime import Runtime
    from stagefs.tiers.status import job_status

    files = _small_files(11)
    t, server, rt = _mount_tier(tmp_path, files, push)
    try:
        names = sorted(files)
        t.mark("list")
        assert sorted(e.name for e in os.scandir(t.mp / "d")) == [n[2:] for n in names]
        t.mark("first")
        assert _read_fd(t.mp / names[0]) == files[names[0]]
        if push:
            _wait(lambda: _counted(rt) == len(files), "the streamed files were not pushed")
        else:
            _wait(lambda: any(v["shards_held"] for v in job_status(Runtime(str(rt)))[
                "tiers"]), "the shard was not streamed")
        t.mark("rest")
        for rel in names[1:]:
            assert _read_fd(t.mp / rel) == files[rel]
        t.mark("end")
        reads = t.requests("rest")["READ"]
        if push:
            assert reads == 0
        else:
            assert reads >= len(files) - 1
        assert _counted(rt) == len(files)  # once each: pushed, or read
        pushed = job_status(Runtime(str(rt)))["pushed"]
        if push:
            assert pushed["reads"] == len(files) - 1
            assert pushed["bytes"] == sum(len(files[n]) for n in names[1:])
        else:
            assert pushed == {"reads": 0, "bytes": 0}
        # the kernel lets go of the pages (memory needed elsewhere) and the program reads
        # every file again (its next epoch): each is a new sample, pushed before or not
        for rel in names:
            fd = os.open(t.mp / rel, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        for rel in names:
            assert _read_fd(t.mp / rel) == files[rel]
        assert _counted(rt) == 2 * len(files)
    finally:
        if is_mounted(str(t.mp)):
            unmount(str(t.mp))
        server.wait(timeout=60)


def test_a_file_bad_at_the_origin_is_never_pushed(tmp_path: Path) -> None:
    """One file's bytes flipped in the pack, in the middle of a shard of about three
    stream reads: the stream's check marks that file bad and streams the rest of the shard
    on; the bad file is never pushed, its read fails with EIO, and every other file reads
    right, pushed or not."""
    rng = random.Random(12)
    files = {f"d/f{i:03d}.bin": rng.randbytes(rng.randint(20_000, 150_000))
             for i in range(120)}
    names = sorted(files)
    bad = names[70]
    t, server, rt = _mount_tier(tmp_path, files, True, corrupt=bad)
    try:
        list(os.scandir(t.mp / "d"))
        assert _read_fd(t.mp / names[0]) == files[names[0]]
        _wait(lambda: b"the rest of the shard streams on" in t.log.read_bytes(),
              "the stream did not name the bad file")
        _wait(lambda: _counted(rt) > 1, "nothing was pushed")
        t.mark("rest")
        for rel in names[1:]:
            if rel == bad:
                with pytest.raises(OSError) as err:
                    _read_fd(t.mp / rel)
                assert err.value.errno == errno.EIO
            else:
                assert _read_fd(t.mp / rel) == files[rel]
        t.mark("end")
        assert t.requests("rest")["READ"] < len(files) - 1  # some were pushed
    finally:
        if is_mounted(str(t.mp)):
            unmount(str(t.mp))
        server.wait(timeout=60)


def test_unmounting_while_files_are_pushed_ends_the_server_cleanly(tmp_path: Path) -> None:
    """Unmounted right after the first read, while the stream brings the shard's files
    and the pusher hands them on: the server stops pushing and exits 0."""
    rng = random.Random(13)
    files = {f"d/f{i:03d}.bin": rng.randbytes(100_000) for i in range(300)}
    t, server, _rt = _mount_tier(tmp_path, files, True)
    try:
        list(os.scandir(t.mp / "d"))
        first = sorted(files)[150]
        assert _read_fd(t.mp / first) == files[first]
    finally:
        if is_mounted(str(t.mp)):
            unmount(str(t.mp))
        assert server.wait(timeout=60) == 0
    log = t.log.read_bytes()
    assert b"Traceback" not in log, log[-2000:]


def test_compressed_files_are_read_not_pushed(tmp_path: Path) -> None:
    """A compressed file's stored bytes are not its content: the stream places it, the
    pusher leaves it, and the program's read of it is a READ that returns its content."""
    from stagefs.runtime import Runtime
    from stagefs.tiers.status import job_status

    rng = random.Random(14)
    files = {f"d/t{i:02d}.txt": (f"line {i} ".encode() * rng.randint(2_000, 9_000))
             for i in range(30)}
    t, server, rt = _mount_tier(tmp_path, files, True, compress="zstd")
    try:
        names = sorted(files)
        list(os.scandir(t.mp / "d"))
        assert _read_fd(t.mp / names[0]) == files[names[0]]
        _wait(lambda: any(v["shards_held"] for v in job_status(Runtime(str(rt)))["tiers"]),
              "the shard was not streamed")
        t.mark("rest")
        for rel in names[1:]:
            assert _read_fd(t.mp / rel) == files[rel]
        t.mark("end")
        assert t.requests("rest")["READ"] >= len(files) - 1
        assert job_status(Runtime(str(rt)))["pushed"]["reads"] == 0
    finally:
        if is_mounted(str(t.mp)):
            unmount(str(t.mp))
        server.wait(timeout=60)
