"""benchmarks/bench_regress.py keeps its generated trees and packs for the next run: a kept
one must be the one this run asks for (its --files, this checkout's packer as it is now),
never one of an earlier run measured under this run's name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_regress.py"


def _run(scratch: Path, files: int) -> dict[str, object]:
    out = scratch.parent / "regress.json"
    env = dict(os.environ, STAGEFS_TIERS=str(scratch.parent / "users-tier"))
    subprocess.run([sys.executable, str(SCRIPT), "--a", str(ROOT / "src"), "--b",
                    str(ROOT / "src"), "--files", str(files), "--runs", "1", "--no-ranges",
                    "--scratch", str(scratch), "--out", str(out)],
                   check=True, capture_output=True, timeout=600, env=env, cwd=ROOT)
    return dict(json.loads(out.read_text()))


def _pack_files(pack: Path) -> int:
    import stagefs

    with stagefs.open(str(pack), tiers=[]) as fs:
        return sum(n != ".complete" for _, _, names in fs.walk("") for n in names)


def test_a_kept_tree_of_another_size_is_not_reused(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    (tmp_path / "users-tier").mkdir()
    _run(scratch, 4)
    res = _run(scratch, 7)
    assert res["files"] == 7
    raw = [n for _, _, names in os.walk(scratch / "raw") for n in names if n != ".complete"]
    assert len(raw) == 7
    assert _pack_files(scratch / "small-a") == _pack_files(scratch / "small-b") == 7
    assert not (scratch / "large").exists()  # --no-ranges: no large files made
    assert os.listdir(tmp_path / "users-tier") == []  # "no tier" took none from the shell
