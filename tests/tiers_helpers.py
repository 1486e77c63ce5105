"""Helpers shared by the tier tests (unit and integration)."""

from __future__ import annotations

import random
from pathlib import Path

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
