"""`stagefs run`'s sweep of the run directories that runs killed with their helper left:
only those nobody listens on are removed."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from stagefs.posix.preload import SIDECAR, sweep_runs


def _run_dir(base: Path, name: str, *, listening: bool | None, sidecar: bool) -> socket.socket:
    """A run directory as `stagefs run` makes it; its helper's socket listening (True),
    bound but not listening (False: the helper killed, or not yet listening) or absent
    (None). The socket is returned for the caller to close."""
    d = base / name
    d.mkdir()
    (d / "empty").mkdir(mode=0o500)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if listening is not None:
        s.bind(f"{name}/helper.sock")  # relative: a socket path is short
        if listening:
            s.listen(1)
    if sidecar:
        (d / SIDECAR).write_bytes(b"STGFSPLD")
    return s


def test_only_runs_nobody_listens_on_are_removed(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    socks = [_run_dir(tmp_path, "stagefs-run-killed", listening=False, sidecar=True),
             _run_dir(tmp_path, "stagefs-run-alive", listening=True, sidecar=True),
             _run_dir(tmp_path, "stagefs-run-starting", listening=False, sidecar=False),
             _run_dir(tmp_path, "stagefs-run-nosocket", listening=None, sidecar=False),
             _run_dir(tmp_path, "other-killed", listening=False, sidecar=True)]
    try:
        gone = sweep_runs(".")
    finally:
        for s in socks:
            s.close()
    assert gone == [os.path.join(".", "stagefs-run-killed")]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "other-killed", "stagefs-run-alive", "stagefs-run-nosocket", "stagefs-run-starting"]


def test_a_missing_base_is_nothing_to_sweep(tmp_path: Path) -> None:
    assert sweep_runs(str(tmp_path / "absent")) == []
