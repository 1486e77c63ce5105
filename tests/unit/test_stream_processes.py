"""Several processes of one node in the cold epoch: one streams a shard (its claim), the
others read from its partial copy (tiers/claims.py, stream.py, chain.py).

- A process that streams a shard ends mid-shard (killed: SIGKILL, a DataLoader worker that
  dies; or its store closed): another process that reads the shard takes its stream over,
  with the tiers full or not. Before, the other processes had found the claim held once and
  never asked again: the rest of the shard was read by their small per-sample reads of the
  origin for the rest of the first epoch.
- The readers of the other processes wait for the bytes that stream brings within
  ``STREAM_WAIT_S``, as the readers of its own process do. Before, they read them
  themselves: with three processes reading one epoch, 30-50% of its origin bytes came in
  small per-sample reads, against under 1% with one."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import stagefs
from conftest import pack_files, random_bytes
from stagefs.tiers import stream as stream_mod
from stagefs.tiers.claims import Claims

SAMPLE = 90_000
N = 130  # 11.7 MB: two shards of 8 MiB

# streams shard 0: its first origin read goes through, the next waits on stdin (a line: the
# store is closed; else it waits until killed, a stream stalled mid-shard)
_STREAMER = """
import sys, threading, stagefs
fs = stagefs.open(sys.argv[1], tiers=[sys.argv[2]], runtime=sys.argv[3])
o = fs.chain.origin
done, go = threading.Event(), threading.Event()
def gate(f):
    def read(shard, off, n, **kw):
        if done.is_set():
            go.wait()
        data = f(shard, off, n, **kw)
        done.set()
        return data
    return read
for name in ("pread", "pread_through"):
    if hasattr(o, name):
        setattr(o, name, gate(getattr(o, name)))
fs.prefetch([0])
done.wait()
print("streaming", flush=True)
sys.stdin.readline()
go.set()
fs.close()
print("closed", flush=True)
"""


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    base = tmp_path_factory.mktemp("takeover")
    files = {f"d{i % 5}/s{i:04d}.jpg": random_bytes(SAMPLE + 7 * i, i) for i in range(N)}
    return pack_files(base, "raw", files), files


def _until(what: str, ok: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.005)


@pytest.mark.parametrize(("end", "full"), [("kill", False), ("close", False), ("kill", True)])
def test_a_stream_whose_process_ended_mid_shard_is_taken_over(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path, end: str,
        full: bool) -> None:
    pack, files = dataset
    with stagefs.open(pack) as probe:
        shard_of = {p: int(probe.manifest.arrays["shard"][probe.namespace.file_entry(p)])
                    for p in files}
        size0 = probe.manifest.shards[0].size
    # full: room for shard 0 and a piece or two more, which the reads of shard 1 take
    cap = f"{size0 + 2 * 2**20}" if full else "1GiB"
    tier = f"{tmp_path / 'tier'}:{cap}"
    child = subprocess.Popen([sys.executable, "-c", _STREAMER, str(pack), tier, str(runtime)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "streaming"
        with stagefs.open(pack, tiers=[tier], runtime=runtime) as fs:
            ch = fs.chain
            assert ch is not None
            fs.prefetch([0])
            # its stream asked for shard 0's claim and found the streamer's
            _until("this process's stream has tried shard 0", ch.stream.idle)
            assert 0 not in ch.stream.started
            if full:
                for p in sorted(p for p in files if shard_of[p] == 1):
                    assert fs.read(p) == files[p]
                assert ch.full
            if end == "kill":
                child.send_signal(signal.SIGKILL)
                child.wait(30)
            else:
                child.stdin.write("\n")
                child.stdin.flush()
                assert child.stdout.readline().strip() == "closed"
            mine = [p for p in files if shard_of[p] == 0]
            random.Random(3).shuffle(mine)
            for p in mine:
                assert fs.read(p) == files[p]
            assert ch.wait_idle(60)
            # the stream went on here: the rest of shard 0 came in its large reads
            assert 0 in ch.stream.started
            assert ch.claims.takeovers == (end == "kill")
            if not full:
                assert 0 in fs.held_shards()
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(30)
        child.stdin.close()
        child.stdout.close()


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_readers_wait_for_the_stream_another_process_runs_on_their_shard(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path) -> None:
    pack, _ = dataset
    with stagefs.open(pack, tiers=[str(tmp_path / "tier")], runtime=runtime) as fs:
        ch = fs.chain
        assert ch is not None
        clock = _Clock()
        # the claim of the process that streams shard 0 (this pid: alive), as it publishes
        # its stream's progress after each run
        other = Claims(ch.claims.folder, ch.claims.pack_id)
        other.clock = ch.claims.clock = clock
        assert not ch.stream.coming(0, 5000)  # no stream on the shard anywhere
        assert other.acquire(0)
        assert not ch.stream.coming(0, 5000)  # claimed, its first run not read yet
        rate = 10e6
        other.publish(0, 2**20, rate)
        # a claim with its progress is still its owner's: never taken over as a damaged one
        assert not ch.claims.acquire(0) and ch.claims.owner(0) == other.owner(0)
        soon = 2**20 + int(rate * stream_mod.STREAM_WAIT_S / 2)
        late = 2**20 + int(rate * stream_mod.STREAM_WAIT_S * 2)
        assert ch.stream.coming(0, 2**20) and ch.stream.coming(0, soon)
        assert not ch.stream.coming(0, late)  # far ahead: read by the reader itself
        assert not ch.stream.coming(0, 2**20 - 1)  # behind it: that stream passed it over
        assert not ch.stream.coming(1, soon)  # another shard
        # a stream that stopped publishing (stopped, stalled on the origin, dead) brings
        # nothing soon
        clock.now += 2 * stream_mod.STREAM_WAIT_S
        assert not ch.stream.coming(0, soon)
        other.publish(0, 2**20, rate)
        assert ch.stream.coming(0, soon)
        other.release(0)
        assert not ch.stream.coming(0, soon)
