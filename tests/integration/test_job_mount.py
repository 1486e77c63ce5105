"""The detached server of ``stagefs mount`` runs in a session of its own, yet stays in the
job of the shell that mounted it (docs/decisions/0010-job-identity.md): ``stagefs clean``
in that shell refuses while the mount is served."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import stagefs
from stagefs.posix.fuse import fuse_available, is_mounted

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(fuse_available() is not None, reason=str(fuse_available())),
]

SRC = str(Path(__file__).resolve().parents[2] / "src")
SHELL = """
set -u
py="$1"; pack="$2"; mp="$3"
"$py" -m stagefs mount "$pack" "$mp" --tier "$4" || exit 9
"$py" -m stagefs clean; echo "clean-while-mounted=$?"
"$py" -m stagefs umount "$mp"
"$py" -m stagefs clean; echo "clean-after=$?"
"""


def test_clean_in_the_mounting_shell_sees_the_detached_server(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"a" * 1000)
    stagefs.pack(src, tmp_path / "pack", jobs=1, progress=False, echo=lambda _m: None)
    mp = tmp_path / "mnt"
    mp.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("STAGEFS_", "SLURM_", "PBS_", "LSB_", "FLUX_", "COBALT_"))}
    env["PYTHONPATH"] = os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])
    try:
        p = subprocess.run(["sh", "-c", SHELL, "sh", sys.executable, str(tmp_path / "pack"),
                            str(mp), f"{tmp_path / 'tier'}:64MiB"], env=env,
                           capture_output=True, text=True, timeout=120,
                           start_new_session=True)  # a shell of its own: a job of its own
    finally:
        if is_mounted(str(mp)):
            subprocess.run([sys.executable, "-m", "stagefs", "umount", str(mp)], env=env,
                           check=False, timeout=60)
    assert "clean-while-mounted=1" in p.stdout, p.stdout + p.stderr
    assert "stagefs.cli mount" in p.stderr and "(job session-" in p.stderr, p.stderr
    assert "clean-after=0" in p.stdout, p.stdout + p.stderr
    assert not (tmp_path / "tier").exists() or os.listdir(tmp_path / "tier") == []
