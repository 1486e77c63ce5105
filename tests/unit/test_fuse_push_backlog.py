"""What the FUSE server keeps of the streamed files it has yet to push into the kernel's
page cache (posix/fuse.py, ``Pusher``): the streams' reads wait in its queue, in this
process's memory, so the queue is bounded by what the push budget (a share of the memory
available at mount, within the job's limit) has left, not only by ``BACKLOG``: under a
job's memory limit a budget of 100 MB let 256 MB of reads wait."""

from __future__ import annotations

from typing import Any

import numpy as np

from stagefs.posix import fuse


class _Stalled(fuse.Pusher):
    """A pusher whose thread pushes nothing (the kernel slower than the streams)."""

    def _run(self) -> None:
        return


def _pusher(budget: int) -> _Stalled:
    store: Any = object()
    return _Stalled(store, "/mnt/ds", None, 0, budget, fuse.Served(8))


def test_the_backlog_stays_within_the_budget_left() -> None:
    p = _pusher(budget=1000)
    try:
        for e in range(4):
            p.arrived(np.array([e]), [(e * 400, bytes(400))])
        assert p._queued == 800  # the third and fourth would pass the budget
        assert p.skipped == 2
        p.bytes = 700  # pushed meanwhile: 300 left, already queued past it
        p.arrived(np.array([5]), [(2000, bytes(1))])
        assert (p._queued, p.skipped) == (800, 3)
    finally:
        p.close()


def test_a_large_budget_is_bounded_by_the_backlog() -> None:
    p = _pusher(budget=1 << 40)
    try:
        run = bytes(1 << 20)
        for e in range(fuse.Pusher.BACKLOG // len(run) + 3):
            p.arrived(np.array([e]), [(e * len(run), run)])
        assert p._queued == fuse.Pusher.BACKLOG
        assert p.skipped == 3
    finally:
        p.close()


def test_the_budget_leaves_what_the_memory_tiers_will_take(tmp_path: Any,
                                                           monkeypatch: Any) -> None:
    """A memory tier fills from the same memory as the page cache, charged to the same job:
    a budget of half the memory available at mount, taken before the tier filled, had pushed
    pages evicted, their files read and counted again (2,279 samples for 1,975 files under a
    700 MiB limit with a 300 MiB memory tier). The tier's room still to come is left out;
    once it holds the dataset, nothing is."""
    import os
    import shutil

    import stagefs

    shm = "/dev/shm"
    if not os.access(shm, os.W_OK):
        import pytest

        pytest.skip("no writable /dev/shm: no memory tier on this machine")
    src = tmp_path / "src"
    src.mkdir()
    for k in range(30):
        (src / f"f{k}").write_bytes(os.urandom(100_000))
    stagefs.pack(str(src), str(tmp_path / "pack"), progress=False)
    monkeypatch.setattr(fuse, "memory_available", lambda: 100 << 20)
    tier = os.path.join(shm, f"stagefs-test-push-{os.getpid()}")
    try:
        with stagefs.open(str(tmp_path / "pack"), tiers=[f"{tier}:1GiB"],
                          runtime=str(tmp_path / "rt")) as fs:
            stored = int(fs.manifest.arrays["stored"].sum())
            assert fuse.push_budget(fs) == int(((100 << 20) - stored) * fuse.PUSH_SHARE)
            fs.read_many([f"f{k}" for k in range(30)])
            assert fs.chain is not None and fs.chain.wait_idle(60)
            assert fuse.push_budget(fs) <= int((100 << 20) * fuse.PUSH_SHARE)
            assert fuse.push_budget(fs) >= int(((100 << 20) - 2**20) * fuse.PUSH_SHARE)
        with stagefs.open(str(tmp_path / "pack"), tiers=[str(tmp_path / "disk")],
                          runtime=str(tmp_path / "rt2")) as fs:  # no memory tier
            assert fuse.push_budget(fs) == int((100 << 20) * fuse.PUSH_SHARE)
    finally:
        shutil.rmtree(tier, ignore_errors=True)
