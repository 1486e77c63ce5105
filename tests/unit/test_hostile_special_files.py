"""A crafted pack whose manifest or shard is a FIFO is refused; it never hangs the reader
(the open of a FIFO waits for a writer)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import stagefs

READ = """
import sys, stagefs
try:
    with stagefs.open(sys.argv[1]) as fs:
        fs.read("a")
    print("read")
except stagefs.StagefsError as exc:
    print("refused:", type(exc).__name__)
"""


@pytest.mark.parametrize("victim", ["manifest.sfm", "shard-000000.sfs"])
def test_a_fifo_in_a_pack_is_refused_not_waited_on(tmp_path: Path, victim: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"x" * 1000)
    pack = tmp_path / "pack"
    stagefs.pack(src, pack, jobs=1, progress=False, echo=lambda _m: None)
    crafted = tmp_path / "crafted"
    shutil.copytree(pack, crafted)
    (crafted / victim).unlink()
    os.mkfifo(crafted / victim)
    try:  # in a child: a hang here would be a hang of the suite
        out = subprocess.run([sys.executable, "-c", READ, str(crafted)], capture_output=True,
                             text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"opening a pack whose {victim} is a FIFO hung")
    assert out.stdout.startswith("refused:"), out.stdout + out.stderr
