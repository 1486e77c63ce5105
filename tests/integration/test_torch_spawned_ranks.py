"""DDP started without a launcher's variables (torch.multiprocessing.spawn, or a script that
passes rank and world size to init_process_group itself): a Sampler made before the process
group cannot know its rank, and must say so rather than give every rank the whole epoch."""

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
ds = FileDataset(sys.argv[1])
early = Sampler(ds, seed=1)                      # before the process group: no rank known
dist.init_process_group("gloo", rank=int(sys.argv[2]), world_size=2,
                        init_method="tcp://127.0.0.1:" + sys.argv[3])
out = {"late": list(Sampler(ds, seed=1))}        # after it: this rank's share
try:
    out["early"] = list(early)
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
dist.destroy_process_group()
"""


def test_a_sampler_made_before_the_process_group_says_so(tmp_path: Path) -> None:
    make_tree(tmp_path / "raw" / "train", n=30, seed=2)
    stagefs.pack(tmp_path / "raw", tmp_path / "pack", shard_size="32KiB", jobs=1,
                 progress=False, echo=lambda _m: None)
    (port,) = free_ports(1)
    launcher = ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path / "pack"), str(r),
                               str(port)], env=env, stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert sorted(i for o in outs for i in o["late"]) == list(range(30))
    for rank, o in enumerate(outs):
        assert "early" not in o  # it used to yield all 30 samples on both ranks
        assert "before torch.distributed was initialised" in o["error"]
        assert f"rank {rank} of 2" in o["error"] and "world_size=" in o["error"]
