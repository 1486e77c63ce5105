"""Helpers of the cluster tests: a small dataset packed into many shards, MPI detection."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys

import stagefs


def make_dataset(root: str, files: int = 120, seed: int = 0) -> dict[str, bytes]:
    """Write ``files`` files (mixed sizes, some compressible, a val/ subtree) under root."""
    rnd = random.Random(seed)
    content: dict[str, bytes] = {}
    for i in range(files):
        sub = "val" if i % 10 == 0 else f"train/c{i % 4}"
        rel = f"{sub}/f{i:04d}.bin" if i % 3 else f"{sub}/t{i:04d}.txt"
        n = rnd.choice([0, 1, 100, 5000, 40_000, 150_000])
        data = rnd.randbytes(n) if rel.endswith(".bin") else (b"line %d\n" % i) * (n // 8)
        os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
        with open(os.path.join(root, rel), "wb") as f:
            f.write(data)
        content[rel] = data
    return content


def make_pack(tmp: str, files: int = 120, shard_size: str = "128KiB") -> tuple[str, dict[str, bytes]]:
    src, dest = os.path.join(tmp, "src"), os.path.join(tmp, "pack")
    content = make_dataset(src, files)
    stagefs.pack(src, dest, shard_size=shard_size, jobs=1)
    return dest, content


def mpiexec() -> str | None:
    """The mpiexec of this environment if mpi4py is importable too, else None."""
    exe = shutil.which("mpiexec")
    if exe is None:
        return None
    ok = subprocess.run([sys.executable, "-c", "import mpi4py"], capture_output=True, timeout=60)
    return exe if ok.returncode == 0 else None
