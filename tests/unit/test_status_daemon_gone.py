"""``stagefs status`` on a node whose daemon was killed (SIGKILL: the OOM killer, Slurm after
KillWait, MPICH's ``mpiexec`` ending every rank when one died), its map left behind: it says
so at once, naming the daemon, instead of showing every node unreachable and, with
``--wait-staged``, waiting out its whole time."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from stagefs.cluster import status
from stagefs.cluster.cmap import ClusterMap, write_map
from stagefs.errors import ClusterError


def _ended_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _closed_port() -> int:
    """A port on 127.0.0.1 nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _left_map(runtime: Path, pid: int) -> None:
    nodes = [("127.0.0.1", _closed_port()) for _ in range(3)]
    write_map(str(runtime), ClusterMap(pack=str(runtime / "pack"), pack_id="00", rank=0,
                                       nodes=nodes, replicas=2, seed=0, everywhere=[],
                                       replicate_all=[], tiers=[], staged=True, pid=pid),
              b"t" * 32)


@pytest.mark.parametrize("wait_staged", [None, 3600.0])
def test_status_says_this_nodes_daemon_is_gone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wait_staged: float | None) -> None:
    runtime = tmp_path / "rt0"
    pid = _ended_pid()
    _left_map(runtime, pid)

    def waited(seconds: float) -> None:
        raise AssertionError("waited for a cluster whose daemon here is gone")

    monkeypatch.setattr(status.time, "sleep", waited)
    with pytest.raises(ClusterError, match=rf"this node's daemon \(node 0, pid {pid}\) has "
                       "ended without removing its map") as err:
        status.print_cluster_status(str(runtime), wait_staged=wait_staged)
    assert "restart the daemons" in str(err.value)


def test_a_live_daemon_that_does_not_answer_is_not_called_gone(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # this process stands for a daemon that is alive but does not answer (stopped, busy)
    runtime = tmp_path / "rt0"
    _left_map(runtime, os.getpid())
    assert status.print_cluster_status(str(runtime)) == 1
    assert "3 node(s) unreachable" in capsys.readouterr().err
