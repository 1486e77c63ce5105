"""A process of the job stopped (kill -STOP, Ctrl-Z, a debugger) while it holds the tiers'
lock or a reservation of a file: the other processes of the node read on, every byte right,
and placing into the tiers goes on once it lets go (docs/decisions/0005-node-local-tiers.md).

Before, a reader stopped inside a reservation (the tiers' lock is taken once per piece) left
every other reader of the node blocked for as long as it stayed stopped."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

import stagefs
from conftest import random_bytes
from stagefs.tiers import chain as chain_mod
from stagefs.tiers import stream as stream_mod

MiB = 2**20

# holds the lock (flock, as the tiers' lock is taken) until its stdin closes: alive, and
# never going on, as a stopped process
_HOLD_FLOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""

# reserves every file of shard 0's copy as a reader does before it reads them from the
# origin, then never reads them
_HOLD_FILES = """
import sys
import stagefs
fs = stagefs.open(sys.argv[1], tiers=[sys.argv[2]])
ch = fs.chain
ext = ch._extents_of(0)
f, t = ch._reserve(0, list(range(ext.pieces)))[0]
h = ch.stream.res.held(0, f)
assert ch.stream.res.take(h, 0, len(ext)), "nothing to reserve"
print("held", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def small_pack(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    files = {f"d/f{i:03d}.bin": random_bytes(40_000 + 997 * i, i) for i in range(60)}
    for rel, data in files.items():
        p = tmp_path / "src" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    out = tmp_path / "src.pack"
    stagefs.pack(tmp_path / "src", out, shard_size="1MiB", jobs=1, progress=False,
                 echo=lambda _m: None)
    return out, files


def _holder(code: str, *args: str) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def _read_all(fs: stagefs.Store, files: dict[str, bytes]) -> dict[str, bytes]:
    """Every file read in a thread; a hang fails the test instead of the suite."""
    got: dict[str, bytes] = {}
    t = threading.Thread(target=lambda: got.update((p, fs.read(p)) for p in files),
                         daemon=True)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), f"reads hung: {len(got)} of {len(files)} files read"
    return got


def test_reads_go_on_while_a_stopped_process_holds_the_tiers_lock(
        small_pack: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    pack, files = small_pack
    monkeypatch.setattr(chain_mod, "TIER_LOCK_WAIT_S", 0.2)
    with stagefs.open(pack, tiers=[f"{tmp_path / 'tier'}:64MiB"]) as fs:
        assert fs.chain is not None
        holder = _holder(_HOLD_FLOCK, fs.chain.tiers[0].room.lock_path)
        try:
            assert _read_all(fs, files) == files
        finally:
            holder.communicate("")
        assert "tier's lock" in caplog.text and "kill -CONT" in caplog.text
        # once it lets go, the tiers are filled again (they were not taken for full)
        assert fs.chain.stage()
        assert fs.held_shards() == set(range(len(fs.manifest.shards)))
        assert _read_all(fs, files) == files


def test_a_read_goes_on_when_a_stopped_reader_holds_its_file(
        small_pack: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    pack, files = small_pack
    monkeypatch.setattr(stream_mod, "HOLDER_WAIT_S", 0.2)
    tier = f"{tmp_path / 'tier'}:64MiB"
    holder = _holder(_HOLD_FILES, str(pack), tier)
    try:
        with stagefs.open(pack, tiers=[tier]) as fs:
            assert _read_all(fs, files) == files
    finally:
        holder.communicate("")
