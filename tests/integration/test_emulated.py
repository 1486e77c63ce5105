"""The emulated cluster (benchmarks/emucluster.py), small: one node and three, each a network
namespace behind a tc-shaped link, a daemon and a training process per node, one daemon
killed halfway through the last epoch. What must hold at any size, checked here: no reader
error and no wrong byte with the node lost, the origin read once during staging, at most two
TCP connections per peer; and the model (benchmarks/scale_sim.py) runs on what was
measured. The figures themselves are the benchmark's (docs/scale.md), never asserted."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_emulated_cluster_and_its_model(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("tc") is None:
        pytest.skip("needs root and tc (iproute2) for network namespaces and shaped links")
    pytest.importorskip("simpy", reason="the model needs SimPy (pip install '.[test]')")
    import emucluster
    import scale_sim

    out = tmp_path / "results"
    code = emucluster.main(["--nodes", "1", "3", "--samples-per-node", "24", "--epochs", "2",
                            "--compute-ms", "200", "--kill", "--origin", str(tmp_path),
                            "--out", str(out)])
    assert code == 0
    doc = json.loads((out / "emulated-kill.json").read_text())
    runs = {r["nodes"]: r for r in doc["runs"]}
    assert set(runs) == {1, 3}
    for r in runs.values():
        assert r["reader_errors"] == 0 and r["checksum_failures"] == 0, r
        assert len(r["epochs_s"]) == 2 and all(t > 0 for t in r["epochs_s"])
        # every shard read from the origin once while staging, whatever N
        assert r["dataset_bytes"] <= r["staging_origin_bytes"] <= 1.05 * r["dataset_bytes"], r
    three = runs[3]
    assert three["killed"] == 2  # the last node's daemon, mid last epoch
    assert three["tcp_peak_per_peer"] <= 2 + 1, three  # data + probes (+ a status request)
    cal = doc["calibration"]
    assert {"link_Bps", "latency_s", "pfs_Bps", "req_s"} <= set(cal), cal
    assert scale_sim.main(["--calibration", str(out / "emulated-kill.json"), "--nodes", "3",
                           "16", "--kill", "--out", str(out / "sim.json")]) == 0
    sim = json.loads((out / "sim.json").read_text())
    rows = {(r["nodes"], r["killed"]): r for r in sim["rows"]}
    assert set(rows) == {(3, False), (3, True), (16, False), (16, True)}
    assert "error_epoch" in rows[(3, True)]  # compared with the measured run: a node lost
