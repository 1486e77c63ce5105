"""``Store.prefetch`` takes shard numbers. A number that is no shard of the pack (the
README's ``fs.prefetch(range(10))`` on a pack of 3 shards, or entry numbers given for
shards) went to the background copy, which failed on it with an IndexError traceback in the
log; the caller was never told. It is refused in the call, naming it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import stagefs


@pytest.fixture
def pack(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):  # one a shard
        (src / f"f{i}.bin").write_bytes(bytes([i]) * 40_000)
    stagefs.pack(src, tmp_path / "pack", shard_size="64KiB", jobs=1, progress=False,
                 echo=lambda _m: None)
    return tmp_path / "pack"


@pytest.mark.parametrize("bad", [[3, 0], [0, -1], ["f0.bin"], [1.0]])
def test_a_number_that_is_no_shard_is_refused(pack: Path, runtime: Path, tmp_path: Path,
                                              bad: list[object]) -> None:
    with stagefs.open(pack, tiers=[str(tmp_path / "t")]) as fs:
        n = len(fs.manifest.shards)
        assert n == 3
        wrong = next(x for x in bad if x not in (0, 1, 2) or isinstance(x, float))
        with pytest.raises(IndexError, match=f"{wrong!r} is not a shard of this pack "
                                             r"\(shards 0 to 2\)"):
            fs.prefetch(bad)  # type: ignore[list-item]
        assert fs.chain is not None and fs.chain.wait_idle(30)
        assert fs.held_shards() == set()  # nothing of the call was queued
        fs.prefetch(np.array([2, 0]))  # numpy's integers are shard numbers too
        assert fs.chain.wait_idle(30)
        assert fs.held_shards() == {0, 2}
