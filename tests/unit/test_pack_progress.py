"""`stagefs pack`'s bar moves as files are written, not only when a whole shard ends: a
pack of many tiny files makes few shards, and the bar sat at 0% for most of the pack."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any, ClassVar

import pytest

import stagefs
from stagefs.format import shard_name

pack_mod = importlib.import_module("stagefs.pack")  # the module (stagefs.pack is the function)


class _Bar:
    """Records what the pack tells its bar (stands in for tqdm)."""

    made: ClassVar[list[_Bar]] = []

    def __init__(self, *args: Any, total: int = 0, **kwargs: Any) -> None:
        self.total, self.n, self.updates, self.disable = total, 0, [], False
        _Bar.made.append(self)

    def update(self, n: int) -> None:
        self.updates.append(n)
        self.n += n

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def test_the_bar_moves_file_by_file_within_one_shard(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    src.mkdir()
    sizes = [100 + i for i in range(40)]
    for i, n in enumerate(sizes):
        (src / f"f{i:02d}").write_bytes(os.urandom(n))
    monkeypatch.setattr(pack_mod, "tqdm", _Bar)
    _Bar.made.clear()
    stagefs.pack(src, tmp_path / "pack", jobs=1, echo=lambda _m: None)
    bar = next(b for b in _Bar.made if b.total == sum(sizes))  # the writers' bar
    assert sorted(bar.updates) == sorted(sizes)  # one step a file, not one for the shard
    assert bar.n == bar.total


def test_a_shard_being_written_counts_what_it_holds_so_far(tmp_path: Path) -> None:
    partial = tmp_path / (shard_name(3) + ".partial")
    assert pack_mod._written(str(tmp_path), 3, 1000) == 0  # not begun
    partial.write_bytes(b"x" * 600)
    assert pack_mod._written(str(tmp_path), 3, 1000) == 600
    assert pack_mod._written(str(tmp_path), 3, 500) == 500  # its padding is not progress


def test_a_shard_renamed_into_place_counts_whole_until_its_worker_reports(
        tmp_path: Path) -> None:
    """Between the rename of its ``.partial`` and its result reaching the pack (the worker
    writes the shard's record, then sends the records back), a shard is whole: counted 0
    there, the bar went back by a shard at each shard's end."""
    (tmp_path / (shard_name(3) + ".partial")).write_bytes(b"x" * 600)
    assert pack_mod._written(str(tmp_path), 3, 1000) == 600
    os.replace(tmp_path / (shard_name(3) + ".partial"), tmp_path / shard_name(3))
    assert pack_mod._written(str(tmp_path), 3, 1000) == 1000
