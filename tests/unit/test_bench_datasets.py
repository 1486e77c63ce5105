"""The generated datasets benchmarks read: what they claim to be."""

from __future__ import annotations

from pathlib import Path

import stagefs
from stagefs.bench.datasets import text_like


def test_text_like_is_compressible_text_the_same_each_time(tmp_path: Path) -> None:
    a = text_like(str(tmp_path / "a"), files=60, mean_size=4000, progress=False)
    b = text_like(str(tmp_path / "b"), files=60, mean_size=4000, progress=False)
    files = sorted((tmp_path / "a").rglob("*.txt"))
    assert a.files == len(files) == 60 and a.bytes == sum(f.stat().st_size for f in files)
    assert all(f.read_bytes() == (tmp_path / "b" / f.relative_to(tmp_path / "a")).read_bytes()
               for f in files) and a.bytes == b.bytes
    assert all(f.read_bytes().replace(b" ", b"").isalpha() for f in files)
    report = stagefs.pack(tmp_path / "a", tmp_path / "pack", jobs=1, progress=False,
                          echo=lambda _m: None)
    assert report.stored_bytes * 2 < report.raw_bytes  # auto keeps zstd: it pays
