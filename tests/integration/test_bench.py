"""``stagefs bench`` end to end on a tiny dataset, every installed system included.

Figures are not asserted (timed tests lie on shared machines); what is asserted is what a
benchmark could silently get wrong: every system read every sample exactly once per epoch,
with the same bytes as every other system, and the outputs are there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stagefs.bench.runner import PEER_PYTHON_ENV
from stagefs.cli import main

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FILES = 48
STAGEFS_SYSTEMS = ["plain-local", "plain-origin", "stagefs-native", "stagefs-torch",
                   "stagefs-intercept", "stagefs-fuse", "stagefs-tiers"]
PEERS = {"webdataset": "webdataset", "streaming": "streaming", "litdata": "litdata"}


def _peer_python() -> str:
    return os.environ.get(PEER_PYTHON_ENV) or sys.executable


def _installed(python: str, module: str) -> bool:
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([python, "-c", code], capture_output=True, timeout=60,
                          check=False).returncode == 0


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:  # type: ignore[type-arg]
    base = tmp_path_factory.mktemp("bench")
    out = base / "out"
    rc = main(["bench", "--files", str(FILES), "--epochs", "2", "--runs", "1",
               "--origin", str(base / "origin"), "--work", str(base / "conv"),
               "--local", str(base / "local"), "--out", str(out), "--no-drop-caches",
               "--peer-python", _peer_python()])
    with open(out / "results.json") as f:
        results = json.load(f)
    assert rc == 0, results.get("skipped")
    return results, out


def test_every_installed_system_ran(bench: tuple[dict, Path]) -> None:  # type: ignore[type-arg]
    results, _ = bench
    expected = ["plain-local", "plain-origin", "stagefs-native"]
    if importlib.util.find_spec("torch") is not None:
        expected += ["stagefs-torch", "stagefs-torch-closed"]
    expected.append("stagefs-intercept")
    peer = _peer_python()
    expected += [name for name, mod in PEERS.items() if _installed(peer, mod)]
    for name in expected:
        assert name in results["systems"], (name, results["skipped"].get(name))
        assert not results["systems"][name]["errors"], results["systems"][name]["errors"]
    # only what is truly absent may be left out, and never for a failed conversion
    for name, why in results["skipped"].items():
        assert "conversion failed" not in why, (name, why)
    if os.environ.get("CI"):  # CI installs the peers: they must have run there
        assert set(PEERS) <= set(results["systems"]), results["skipped"]


def test_each_sample_once_with_the_same_bytes(bench: tuple[dict, Path]) -> None:  # type: ignore[type-arg]
    results, _ = bench
    assert results["dataset"]["files"] == FILES
    ref = results["reference_checksum"]
    for name, s in results["systems"].items():
        assert len(s["epochs"]) == 2, name
        for e in s["epochs"]:
            assert e["samples"] == FILES and e["distinct"] == FILES, (name, e)
            assert e["checksum"] == ref, name
            assert e["bytes"] == results["dataset"]["bytes"], name
        assert s["all_samples_once"] and s["same_bytes"], name


def test_outputs_exist(bench: tuple[dict, Path]) -> None:  # type: ignore[type-arg]
    results, out = bench
    table = (out / "table.md").read_text()
    for name in results["systems"]:
        assert f"| {name} " in table
    assert "stagefs bench --dataset imagenet-like --files 48" in table
    for name, s in results["systems"].items():
        assert s["conversion"]["bytes_on_disk"] > 0, name
        for key in ("seconds", "cpu_seconds", "peak_rss", "origin_opens", "origin_bytes"):
            assert all(key in e for e in s["epochs"]), (name, key)
    # the cold epochs are held against the origin's sequential limit, one and several streams
    assert sorted({p["streams"] for p in results["origin_limit"]}) == [1, 6]
    assert sorted(p["kept"] for p in results["origin_limit"] if p["run"] == 0) == [0, 0, 1]
    assert all(p["bytes"] > 0 for p in results["origin_limit"])
    assert "The origin's sequential limit" in table and "| / 6 streams kept |" in table
    # plain reads from the origin open every file there; a pack opens a few shards
    sysd = results["systems"]
    assert all(e["origin_opens"] >= FILES for e in sysd["plain-origin"]["epochs"])
    assert sysd["stagefs-native"]["epochs"][0]["origin_opens"] < FILES
    if importlib.util.find_spec("matplotlib") is not None:
        for png in ("throughput.png", "epochs.png", "origin_ops.png"):
            assert (out / png).stat().st_size > 1000, png


def test_both_modes_are_reported_under_stagefs_closed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``STAGEFS_CLOSED=1`` set in the shell (as for a CLOSED submission): the open mode's
    row still runs open, beside the closed one, and both read every sample right."""
    pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")
    monkeypatch.setenv("STAGEFS_CLOSED", "1")
    out = tmp_path / "out"
    rc = main(["bench", "--files", "16", "--epochs", "1", "--runs", "1",
               "--systems", "stagefs-torch", "stagefs-torch-closed",
               "--origin", str(tmp_path / "origin"), "--work", str(tmp_path / "conv"),
               "--local", str(tmp_path / "local"), "--out", str(out), "--no-drop-caches"])
    with open(out / "results.json") as f:
        systems = json.load(f)["systems"]
    assert rc == 0, {n: s["errors"] for n, s in systems.items()}
    assert set(systems) == {"stagefs-torch", "stagefs-torch-closed"}
    for name, s in systems.items():
        assert not s["errors"] and s["all_samples_once"] and s["same_bytes"], (name, s)
