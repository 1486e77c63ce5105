"""Several real processes on one node sharing the tiers: each shard placed once, every byte
right; a process killed while placing; a store pickled into spawned and forked workers; the
test PFS as the origin."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from xxhash import xxh3_64_intdigest

import stagefs
from tiers_helpers import make_tree

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
UNIT = HERE.parent / "unit"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, int]]:
    base = tmp_path_factory.mktemp("mp")
    files = make_tree(base / "raw", n=200, seed=21)
    stagefs.pack(base / "raw", base / "pack", shard_size="48KiB", jobs=1, progress=False,
                 echo=lambda _m: None)
    return base / "raw", base / "pack", {p: xxh3_64_intdigest(d) for p, d in files.items()}


def _reader(origin: str, tiers: list[str], runtime: str, sums: dict[str, int], seed: int,
            start: Any) -> dict[str, Any]:
    """In a worker process: read every file in a random order, check it, report counters."""
    start.wait(60)
    bad = 0
    with stagefs.open(origin, tiers=tiers, runtime=runtime) as fs:
        paths = sorted(sums)
        random.Random(seed).shuffle(paths)
        for epoch in range(2):
            for p in paths:
                if xxh3_64_intdigest(fs.read(p)) != sums[p]:
                    bad += 1
            if epoch == 0:
                assert fs.chain is not None
                fs.chain.wait_idle(60)
                # others may still be placing what they claimed: wait until all is held
                deadline = time.monotonic() + 60
                while _held(fs) < _pieces(fs) and time.monotonic() < deadline:
                    time.sleep(0.02)
        st = fs.status()
        return {"bad": bad, "reserved": sum(t["pieces"] for t in st["tiers"]),
                "filled": sum(t["filled"] for t in st["tiers"]), "claims": st["claims"],
                "held": _held(fs), "pieces": _pieces(fs), "hits": st["hits"]}


def _pieces(fs: stagefs.Store) -> int:
    """The placement pieces of the dataset's shards."""
    assert fs.chain is not None
    return sum(fs.chain._extents_of(s).pieces for s in range(len(fs.manifest.shards)))


def _held(fs: stagefs.Store) -> int:
    """The pieces some tier holds (a shard's pieces may lie in both: the memory tier is
    smaller than a shard here)."""
    assert fs.chain is not None
    return len(set().union(*fs.chain.held_pieces().values()))


@pytest.mark.parametrize("method", ["spawn", "fork"])
@pytest.mark.parametrize("which", ["pack", "raw"])
def test_processes_share_tiers(method: str, which: str,
                               dataset: tuple[Path, Path, dict[str, int]],
                               tmp_path: Path) -> None:
    raw, pack, sums = dataset
    origin = str(pack if which == "pack" else raw)
    tiers = [f"{tmp_path / 'mem'}:200KiB", str(tmp_path / "disk")]
    runtime = str(tmp_path / "rt")
    if which == "raw":  # build the in-place manifest once, as a job's first open would
        stagefs.open(origin, runtime=runtime).close()
    ctx = mp.get_context(method)
    n = 3
    with ctx.Manager() as manager:
        start = manager.Event()
        with ctx.Pool(n) as pool:
            jobs = [pool.apply_async(_reader, (origin, tiers, runtime, sums, seed, start))
                    for seed in range(n)]
            time.sleep(0.2)
            start.set()
            results = [j.get(timeout=180) for j in jobs]
    pieces = results[0]["pieces"]
    assert all(r["bad"] == 0 for r in results)
    assert all(r["held"] == pieces for r in results), results
    # each piece reserved exactly once, by one of the processes (the streams', a placer's,
    # a read's): then placed by it, or by the reads that filled it
    assert sum(r["reserved"] for r in results) == pieces, results
    assert sum(r["filled"] for r in results) > 0  # the reads filled the tiers too
    assert all(r["hits"] > 0 for r in results), results  # all read the placed shards


def test_store_pickled_into_workers(dataset: tuple[Path, Path, dict[str, int]],
                                    tmp_path: Path) -> None:
    _, pack, sums = dataset
    with stagefs.open(pack, tiers=[str(tmp_path / "t")], runtime=tmp_path / "rt") as fs:
        fs.chain.stage()  # type: ignore[union-attr]
        for method in ("spawn", "fork"):
            with mp.get_context(method).Pool(2) as pool:
                got = pool.starmap(_read_some, [(fs, sorted(sums)[i::2]) for i in range(2)])
            assert {k: v for part in got for k, v in part[0].items()} == sums
            assert all(part[1] == 0 for part in got)  # all from the tiers: no origin bytes


def _read_some(fs: stagefs.Store, paths: list[str]) -> tuple[dict[str, int], int]:
    out = {p: xxh3_64_intdigest(fs.read(p)) for p in paths}
    return out, fs.origin.stats.bytes_read


_SLOW_PLACER = """
import sys, time, stagefs
import stagefs.tiers.placer as placer
placer.CHUNK = 4096
origin, tier, runtime = sys.argv[1:4]
fs = stagefs.open(origin, tiers=[tier], runtime=runtime)
slow = fs.origin.pread
def pread(shard, off, n):
    time.sleep(0.05)
    return slow(shard, off, n)
fs.origin.pread = pread
fs.chain.stage()
"""


def test_killed_while_placing(dataset: tuple[Path, Path, dict[str, int]],
                              tmp_path: Path) -> None:
    _, pack, sums = dataset
    tier, runtime = tmp_path / "tier", tmp_path / "rt"
    child = subprocess.Popen([sys.executable, "-c", _SLOW_PLACER, str(pack), str(tier),
                              str(runtime)])
    try:
        deadline = time.monotonic() + 60
        partial = None
        while time.monotonic() < deadline and partial is None:
            partial = next(iter(tier.glob("*/*.partial")), None)
            time.sleep(0.01)
        assert partial is not None, "the child never started placing"
        time.sleep(0.1)
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
    final = Path(str(partial)[: -len(".partial")])
    assert not final.exists()  # no half shard under its final name
    claims = list((runtime / "claims").glob("*.[0-9]*"))
    assert claims, "the dead placer's claim is still there"
    with stagefs.open(pack, tiers=[str(tier)], runtime=runtime) as fs:
        assert fs.chain is not None
        held = fs.held_shards()
        index = fs.manifest.shards.index(next(s for s in fs.manifest.shards
                                              if s.name == final.name))
        assert index not in held
        # the dead placer's claim is taken over; what it had copied and checked is kept
        # (its partial copy's fill map), so the rest of that shard is all that is read
        fs.chain.stage()
        assert fs.chain.claims.takeovers >= 1
        assert fs.held_shards() == set(range(len(fs.manifest.shards)))
        stored = sum(s.size - 64 for i, s in enumerate(fs.manifest.shards) if i not in held)
        assert fs.chain.origin.stats.bytes_read < stored
        for p in sorted(sums):  # nothing half-written is ever read
            assert xxh3_64_intdigest(fs.read(p)) == sums[p]
        assert not list(tier.glob("*/*.partial"))
        assert not list(tier.glob("*/*.fill"))


PFS = Path("/tmp/pfs")


def test_on_the_test_pfs(tmp_path: Path) -> None:
    """The real shared file system as the origin: a pack and a raw tree on it."""
    if subprocess.run(["mountpoint", "-q", str(PFS)], timeout=30).returncode != 0:
        pytest.skip("the test PFS is not mounted at /tmp/pfs (shared/testbed/pfs.sh start)")
    base = PFS / f"tiers-test-{os.getpid()}"
    try:
        files = make_tree(base / "raw", n=150, seed=4)
        stagefs.pack(base / "raw", base / "pack", shard_size="64KiB", jobs=1, progress=False,
                     echo=lambda _m: None)
        for origin in (base / "pack", base / "raw"):
            with stagefs.open(origin, tiers=[str(tmp_path / "t")], runtime=tmp_path / "rt") as fs:
                assert fs.chain is not None
                for p in sorted(files):
                    assert fs.read(p) == files[p]
                fs.chain.wait_idle(60)
                before = fs.origin.stats.as_dict()
                for p in sorted(files):
                    assert fs.read(p) == files[p]
                assert fs.origin.stats.as_dict() == before
                if origin.name == "pack":
                    assert before["opens"] == len(fs.manifest.shards)
    finally:
        shutil.rmtree(base, ignore_errors=True)
