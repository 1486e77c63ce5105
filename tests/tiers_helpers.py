"""Helpers shared by the tier tests (unit and integration)."""

from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import random_bytes, text_bytes


def make_tree(root: Path, n: int = 120, seed: int = 3) -> dict[str, bytes]:
    """Random (stored raw) and text (stored zstd) files, a few empty, over a few dirs."""
    rng = random.Random(seed)
    files: dict[str, bytes] = {}
    for i in range(n):
        kind = rng.choice(["random", "random", "text", "empty"])
        size = rng.randint(1, 9000)
        data = {"random": random_bytes(size, i), "text": text_bytes(size, i), "empty": b""}[kind]
        files[f"c{i % 5}/f{i:04d}.bin"] = data
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return files


def compile_c(tmp_path_factory: pytest.TempPathFactory, name: str, source: str,
              *flags: str) -> Path:
    """A test's C program, built once per module with the system's compiler (skips the
    test where there is none)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp(name)
    (d / "probe.c").write_text(source)
    subprocess.run([cc, "-O1", *flags, "-o", d / "probe", d / "probe.c"], check=True)
    return d / "probe"


def packed_tree(base: Path, *, n: int = 120, seed: int = 3,
                shard_size: str = "64KiB") -> tuple[Path, dict[str, bytes]]:
    """make_tree under ``base/raw``, packed quietly into ``base/pack``: (pack, files)."""
    import stagefs

    files = make_tree(base / "raw", n=n, seed=seed)
    stagefs.pack(base / "raw", base / "pack", shard_size=shard_size, jobs=1, progress=False,
                 echo=lambda _m: None)
    return base / "pack", files
