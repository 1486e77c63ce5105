"""A Store let go of without close() gives back what it holds; one that is still in use
(through a file object, or rebuilt in a DataLoader worker from its pickle) keeps it."""

from __future__ import annotations

import gc
import os
import pickle
from pathlib import Path

import stagefs
from conftest import random_bytes


def _open_fds_under(*dirs: Path) -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own descriptor, closed already
        if any(target.startswith(str(d)) for d in dirs):
            out.append(target)
    return out


def _pack(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    src = tmp_path / "src"
    src.mkdir()
    files = {f"f{i}": random_bytes(3000 + i, seed=i) for i in range(12)}
    for name, data in files.items():
        (src / name).write_bytes(data)
    stagefs.pack(src, tmp_path / "pack", progress=False, echo=lambda _m: None)
    return tmp_path / "pack", files


def test_a_store_dropped_without_close_gives_back_its_descriptors(tmp_path: Path,
                                                                   runtime: Path) -> None:
    pack, files = _pack(tmp_path)
    tier = tmp_path / "tier"
    for _ in range(5):  # as `stagefs.open(p).read(name)` in a loop does
        assert stagefs.open(pack).read("f1") == files["f1"]
        fs = stagefs.open(pack, tiers=[f"{tier}:10MB"])
        assert fs.read_many(["f2", "f3"]) == [files["f2"], files["f3"]]
        del fs
    gc.collect()
    assert _open_fds_under(pack, tier, runtime) == []


def test_a_file_object_keeps_its_store_open(tmp_path: Path, runtime: Path) -> None:
    pack, files = _pack(tmp_path)
    f = stagefs.open(pack).open("f4")
    gc.collect()
    assert f.read() == files["f4"]
    f.close()


def test_a_store_rebuilt_from_its_pickle_keeps_what_it_was_given(tmp_path: Path,
                                                                 runtime: Path) -> None:
    """A worker's copy is opened again and takes over the new store's insides: the
    short-lived store that opened them must not close them when it goes."""
    pack, files = _pack(tmp_path)
    with stagefs.open(pack, tiers=[f"{tmp_path / 'tier'}:10MB"]) as fs:
        copy = pickle.loads(pickle.dumps(fs))
        gc.collect()
        assert copy.read_many(["f5", "f6"]) == [files["f5"], files["f6"]]
        assert copy.read("f7") == files["f7"]
        copy.close()
