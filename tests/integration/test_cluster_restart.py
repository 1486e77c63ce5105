"""The daemons of a cluster started again under live readers: each reader goes on, every
byte right, and reads through the new daemons once they are back."""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import shutil
from pathlib import Path

import pytest
from cluster_helpers import hosts_daemons, make_pack, stop, tail, wait_staged

import stagefs
from conftest import held_deleted

pytestmark = pytest.mark.integration


def _staged(work: str, n: int, daemons: list) -> None:  # type: ignore[type-arg]
    for r, d in enumerate(daemons):
        wait_staged(work, n, d, timeout=120, log=os.path.join(work, f"daemon{r}.log"))


def _three_nodes(work: str) -> tuple[str, dict[str, bytes], list]:  # type: ignore[type-arg]
    """A pack of 120 files in ``work`` staged by 3 daemons of a hosts file (64 MiB tiers):
    the pack, its files' bytes, the daemons."""
    pack, content = make_pack(work, files=120)
    daemons = hosts_daemons(work, pack, 3, "64MiB", "--progress", "0")
    try:
        _staged(work, 3, daemons)
    except BaseException:
        for d in daemons:
            stop(d)
        raise
    return pack, content, daemons


@pytest.mark.parametrize(("token", "tiers"), [("new", "kept"), ("new", "emptied"),
                                             ("same", "emptied")])
def test_a_reader_reads_through_daemons_started_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, token: str, tiers: str) -> None:
    """Daemons started again as ``mpiexec`` starts them (a new job token, new ports): a
    reader connected to the first ones read what its node did not hold from the origin
    for its life, every daemon refusing its old token (and its log said the nodes of the
    job disagreed on the token). Their tiers emptied meanwhile (with a new token or the
    same --token-file and hosts file), it held the old copies open (deleted, their blocks
    pinned: memory, on a memory tier) for its life."""
    n, work = 3, str(tmp_path)
    pack, content, daemons = _three_nodes(work)
    paths = sorted(content)
    try:
        with stagefs.connect(os.path.join(work, "rt0")) as fs:
            holders = fs._policy  # type: ignore[attr-defined]
            ticks = itertools.count(step=10.0)
            holders.clock = lambda: next(ticks)  # the map may be read at every look

            def origin_bytes() -> int:
                return int(fs.status()["holders"]["origin"]["bytes"])

            def epoch() -> int:
                before = origin_bytes()
                for i in range(0, len(paths), 16):
                    batch = paths[i : i + 16]
                    assert fs.read_many(batch) == [content[p] for p in batch]
                for p in paths[::7]:
                    assert fs.read(p) == content[p]
                return origin_bytes() - before

            first = epoch()
            assert first == 0, "the cluster holds every shard: none from the origin"
            for d in daemons:
                assert stop(d) == 0
            # a new token and new ports, the same runtime and tier directories
            if token == "new":
                os.unlink(os.path.join(work, "token"))
            if tiers == "emptied":
                for r in range(n):
                    shutil.rmtree(os.path.join(work, f"node{r}", "disk"))
            daemons = hosts_daemons(work, pack, n, "64MiB", "--progress", "0",
                                    again=token == "same")
            _staged(work, n, daemons)
            with caplog.at_level(logging.INFO, logger="stagefs"):
                epoch()  # (its first reads find the old daemons gone)
                assert epoch() == first, tail(os.path.join(work, "daemon0.log"))
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING], \
                caplog.text  # a restart, not nodes that disagree on the token
            st = fs.status()
            assert st["fabric"]["requests"] > 0, st
            assert held_deleted(work) == []
    finally:
        for d in daemons:
            stop(d)


def test_a_store_sent_to_a_worker_while_the_daemons_restart_opens_there(
        tmp_path: Path) -> None:
    """A store pickled to a spawned DataLoader worker (spawn, forkserver) that opens while
    the daemons are between two starts: it waited 30 s for their map and raised
    ClusterError (the training stopped); it reads as its sender did, then through the new
    daemons once they are back."""
    n, work = 3, str(tmp_path)
    pack, content, daemons = _three_nodes(work)
    paths = sorted(content)
    try:
        with stagefs.connect(os.path.join(work, "rt0")) as fs:
            sent = pickle.dumps(fs)
        for d in daemons:
            assert stop(d) == 0
        with pickle.loads(sent) as worker:
            ticks = itertools.count(step=10.0)
            worker._policy.clock = lambda: next(ticks)  # type: ignore[attr-defined]
            assert worker.read_many(paths) == [content[p] for p in paths]
            os.unlink(os.path.join(work, "token"))  # (mpiexec's: a new token, new ports)
            daemons = hosts_daemons(work, pack, n, "64MiB", "--progress", "0")
            _staged(work, n, daemons)
            worker.read_many(paths)  # (its first reads find the daemons back)
            before = worker.status()["holders"]["origin"]["bytes"]
            assert worker.read_many(paths) == [content[p] for p in paths]
            assert worker.status()["holders"]["origin"]["bytes"] == before
    finally:
        for d in daemons:
            stop(d)
