"""Locality gathers every rank's holdings through torch.distributed, one entry per process
of its world. A Sampler given ``rank``/``world_size`` of another group (data parallel inside
a larger world) cannot be told its ranks' holdings that way: it must say so and name
``held_by``, which works, rather than fail deep inside the gather."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cluster_helpers import free_ports

pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import stagefs
from tiers_helpers import make_tree

pytestmark = pytest.mark.integration

RANK = """
import json, sys
import torch.distributed as dist
from stagefs.torch import FileDataset, Sampler
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + sys.argv[2])
ds = FileDataset(sys.argv[1])
out = {}
try:
    Sampler(ds, seed=1, locality=True, rank=1, world_size=2)
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
given = Sampler(ds, seed=1, locality=True, rank=1, world_size=2, held_by=[[0], [1]])
out["given"] = given.order().tolist()
print(json.dumps(out))
dist.destroy_process_group()
"""


def test_locality_in_another_group_than_the_world_names_held_by(tmp_path: Path) -> None:
    make_tree(tmp_path / "raw" / "train", n=30, seed=2)
    stagefs.pack(tmp_path / "raw", tmp_path / "pack", shard_size="32KiB", jobs=1,
                 progress=False, echo=lambda _m: None)
    (port,) = free_ports(1)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    p = subprocess.run([sys.executable, "-c", RANK, str(tmp_path / "pack"), str(port)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    # it was a TypeError from inside the gather (None where rank 1's holdings should be)
    assert out["error"].startswith("ConfigError: "), out["error"]
    assert "rank 0 of 1" in out["error"] and "held_by" in out["error"]
    assert len(out["given"]) == 15
