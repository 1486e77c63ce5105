"""The first epoch of a dataset of raw files larger than ``FILE_LIMIT``, read whole by
several processes of a node at once: every origin byte is read once, whoever reads it (a
reader that found no stream of its own on the shard read the file past its copy, and the
other process's stream read it again: 56 MiB of a 70 MB file, twice)."""

from __future__ import annotations

import multiprocessing as mp
import random
from pathlib import Path
from typing import Any

import pytest

import stagefs
from stagefs.format import PIECE
from stagefs.tiers import stream as stream_mod

pytestmark = pytest.mark.integration


def _read(pack: str, tiers: list[str], runtime: str, start: Any, out: Any) -> None:
    start.wait(60)
    with stagefs.open(pack, tiers=tiers, runtime=runtime) as fs:
        ok = all(fs.read(p) == fs.read(p) for p in ("big0.bin", "big1.bin"))
        assert fs.chain is not None
        fs.chain.wait_idle(60)
        out.put((ok, int(fs.origin.stats.bytes_read)))


def test_large_files_read_whole_by_three_processes_come_over_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    rng = random.Random(3)
    sizes = (24 * PIECE + 5, 20 * PIECE + 7)
    for k, n in enumerate(sizes):
        (raw / f"big{k}.bin").write_bytes(rng.randbytes(n))
    stagefs.pack(raw, tmp_path / "pack", compress="none", jobs=1, progress=False,
                 echo=lambda _m: None)
    # past FILE_LIMIT (its 64 MiB made small, inherited by the forked readers)
    monkeypatch.setattr(stream_mod, "FILE_LIMIT", 2 * PIECE)
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    tiers = [f"{tmp_path / 'mem'}:1GiB"]
    procs = [ctx.Process(target=_read, args=(str(tmp_path / "pack"), tiers,
                                             str(tmp_path / "rt"), start, out))
             for _ in range(3)]
    for p in procs:
        p.start()
    start.set()
    got = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    assert all(ok for ok, _ in got)
    # the files' bytes and the padding between them, once across the processes
    assert sum(n for _, n in got) <= sum(sizes) + 2 * 4096, got
