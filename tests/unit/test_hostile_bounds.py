"""Bounded work whatever a manifest holds: lookups probe one pass of the hash table at most
(in Python and in the C accelerator), a tree of any depth is walked without recursion, and
shard names never name a file outside the pack directory."""

from __future__ import annotations

import os
import stat as st
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hostile_packs import CASES, run_bounded
from stagefs.errors import CorruptManifestError
from stagefs.format import KIND_DIR, MANIFEST_NAME, Manifest
from stagefs.format.manifest import Entry, ManifestBuilder
from stagefs.format.validate import check_shard_name
from stagefs.namespace import Namespace

CORPUS = Path(__file__).parent.parent / "data" / "hostile"
LIMIT = 60.0  # seconds before a lookup counts as hung


@pytest.fixture(params=["1", "0"], ids=["accelerated", "python"])
def speedups(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    if request.param == "1":
        pytest.importorskip("stagefs._speedups", reason="the C accelerator is not built")
    monkeypatch.setenv("STAGEFS_SPEEDUPS", request.param)
    return request.param == "1"


def _deep_manifest(path: Path, depth: int) -> list[bytes]:
    b = ManifestBuilder()
    b.add(Entry(b"", KIND_DIR, st.S_IFDIR | 0o755, 0))
    dirs = [b"/".join([b"d"] * k) for k in range(1, depth + 1)]
    for d in dirs:
        b.add(Entry(d, KIND_DIR, st.S_IFDIR | 0o755, 0))
    b.write(str(path))
    return dirs


def test_walk_a_tree_deeper_than_the_recursion_limit(tmp_path: Path, speedups: bool) -> None:
    """walk was recursive: a deep tree (a crafted one, or a real one) raised RecursionError."""
    dirs = _deep_manifest(tmp_path / MANIFEST_NAME, 1500)
    m = Manifest(str(tmp_path / MANIFEST_NAME))
    try:
        ns = Namespace(m)
        assert ns.accelerated is speedups
        walked = [d for d, _, _ in ns.walk("")]
        assert walked == ["", *(os.fsdecode(d) for d in dirs)]
        bottom_up = [d for d, _, _ in ns.walk(b"", topdown=False)]
        assert bottom_up == [*reversed(dirs), b""]
        assert ns.listdir(dirs[-2]) == [b"d"] and ns.stat(dirs[-1]).st_nlink == 2
        pruned = []
        for d, subdirs, _ in ns.walk(""):
            pruned.append(d)
            if d.count("/") == 9:
                subdirs.clear()  # pruning in place stops the walk there, as in os.walk
        assert len(pruned) == 11
    finally:
        m.close()


def test_python_lookup_stops_after_one_pass(tmp_path: Path) -> None:
    """Were the table full (open refuses one), a lookup of a missing path still ends."""
    _deep_manifest(tmp_path / MANIFEST_NAME, 3)
    m = Manifest(str(tmp_path / MANIFEST_NAME))
    full = np.ones(len(m.slots), dtype="<u4")  # every slot holds entry 0 (the root)
    m.slots = memoryview(full).cast("B").cast("I")
    try:
        out = run_bounded(lambda: (m.lookup(b"nope"), m.lookup(b"")), LIMIT)
        assert out.value == (-1, 0), out
    finally:
        m.close()


def _index(arrays: dict[str, Any]) -> Any:
    speedups = pytest.importorskip("stagefs._speedups", reason="the C accelerator is not built")
    return speedups.Index(arrays["slots"], arrays["hash"], arrays["path_off"], arrays["strings"],
                          arrays["kind"], arrays["mode"], arrays["size"], arrays["mtime_ns"],
                          os.stat_result, lambda p: "fallback", 1, 0, 0, 2**20)


def _arrays(path: Path) -> dict[str, Any]:
    _deep_manifest(path, 3)
    m = Manifest(str(path))
    arrays = {k: np.array(v) for k, v in m.arrays.items()}  # writable copies
    m.close()
    return arrays


def test_c_lookup_stops_after_one_pass(tmp_path: Path) -> None:
    a = _arrays(tmp_path / MANIFEST_NAME)
    a["slots"][:] = 1  # full: every probe finds the root, whose path is not the key
    index = _index(a)
    out = run_bounded(lambda: (index.find("nope"), index.lookup(b"nope"), index.stat("nope"),
                               index.lookup(b"d/d")), LIMIT)
    assert out.value == (-1, -1, "fallback", -1), out


def test_c_lookup_never_reads_outside_the_arrays(tmp_path: Path) -> None:
    a = _arrays(tmp_path / MANIFEST_NAME)
    a["slots"][a["slots"] != 0] = 2**32 - 1  # entries far past the end
    a["path_off"][1:] = 2**63  # paths far past the strings
    index = _index(a)
    out = run_bounded(lambda: [index.lookup(p) for p in (b"", b"d", b"d/d", b"x")], LIMIT)
    assert out.value == [-1, -1, -1, -1], out


def test_c_index_refuses_arrays_of_different_lengths(tmp_path: Path) -> None:
    a = _arrays(tmp_path / MANIFEST_NAME)
    a["kind"] = a["kind"][:-1]
    with pytest.raises(ValueError, match="one item per entry"):
        _index(a)
    a = _arrays(tmp_path / MANIFEST_NAME)
    a["slots"] = a["slots"][:3]
    with pytest.raises(ValueError, match="power of two"):
        _index(a)


@pytest.mark.parametrize("case", ["full_hash_table", "shard_name_dotdot", "parent_cycle"])
def test_checked_without_the_checksum_too(case: str) -> None:
    """verify=False skips the body checksum (a caller that just checked it), not the checks."""
    with pytest.raises(CorruptManifestError, match=CASES[case][1]):
        Manifest(str(CORPUS / case / MANIFEST_NAME), verify=False)


@pytest.mark.parametrize("name", ["shard-000000.sfs", "x y", "caf\u00e9", "\udcff", "a.b",
                                  "...", ".hidden"])
def test_plain_shard_names_are_accepted(name: str) -> None:
    check_shard_name(name, "m", 0)


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "/etc/passwd", "../x", "a\0b",
                                  "s.partial", "s.fill", "x" * 250, "\ud800", 5, None,
                                  ["a"]])
def test_shard_names_that_could_leave_the_directory_are_refused(name: Any) -> None:
    with pytest.raises(CorruptManifestError, match=r"shard name .* re-pack the dataset"):
        check_shard_name(name, "m", 0)

