"""The emulated cluster (benchmarks/emucluster.py) with a partition: four nodes, one of them
cut off from the others (its link down) halfway through the first epoch for longer than the
daemons' --dead-after, then connected again. What must hold, checked here: no reader error
and no wrong byte on either side, the cut-off node re-replicates nothing from the origin (it
sees itself as the one cut off, not the others as dead), nor do the others (every shard of
the cut-off node has another replica), and once the link is back every node sees every
other live again. The figures (epoch times, origin fallbacks) are the benchmark's
(docs/scale.md), never asserted."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_a_partitioned_node_rejoins_and_no_byte_is_wrong(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("tc") is None:
        pytest.skip("needs root and tc (iproute2) for network namespaces and shaped links")
    import emucluster

    out = tmp_path / "results"
    code = emucluster.main(["--nodes", "4", "--samples-per-node", "48", "--epochs", "2",
                            "--compute-ms", "200", "--partition", "6", "--partition-nodes",
                            "1", "--dead-after", "2", "--origin", str(tmp_path),
                            "--out", str(out)])
    assert code == 0
    run = json.loads((out / "emulated-partition.json").read_text())["runs"][0]
    assert run["reader_errors"] == 0 and run["wrong_samples"] == 0, run
    assert run["checksum_failures"] == 0, run
    p = run["partition"]
    assert p["nodes"] == [3]
    assert p["healed_at_s"] - p["cut_at_s"] >= 6
    cut = p["cut_off"]["3"]
    assert cut["reader"]["errors"] == 0 and cut["reader"]["wrong"] == 0, cut
    # cut off, it did not take the other three for dead and copy their shards from the origin
    assert not cut["daemon_during"]["from_origin_bytes"], cut
    assert not cut["daemon_after"]["from_origin_bytes"], cut
    assert p["others"]["reader_errors"] == 0, p
    assert p["others"]["rereplicated_from_origin_bytes"] == 0, p
    assert p["rejoin_s"] is not None, p  # healed: every node sees every other live again
