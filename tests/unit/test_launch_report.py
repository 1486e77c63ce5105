"""Rank 0's final staging report when the job is stopped (mpiexec's SIGTERM, scancel) in the
seconds between the end of staging and the report: the peers, stopping too, answer no more,
and a report of those that did ("staged ... on 1 nodes ... 0.25x the dataset") was false."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from stagefs.cluster.daemon import Daemon


def _node(held: int) -> dict[str, Any]:
    return {"staging": {"origin_bytes": held, "forwarded_bytes": 0, "bytes_held": held,
                        "started": 0.0, "finished": 1.0}}


def _daemon(stopped: bool) -> Daemon:
    d = Daemon.__new__(Daemon)  # the report's inputs only: no bootstrap, tiers or server
    d.stop = threading.Event()
    if stopped:
        d.stop.set()
    d.manifest = SimpleNamespace(shards=[SimpleNamespace(size=1000)] * 4)  # type: ignore[assignment]
    d._gather = lambda: [_node(1000), None, None, None]  # type: ignore[method-assign]
    d.placement = SimpleNamespace(replicas=1)  # type: ignore[assignment]
    return d


def test_no_final_report_of_the_nodes_that_answered_after_a_stop(
        capsys: pytest.CaptureFixture[str]) -> None:
    _daemon(stopped=True)._final_report()
    assert "staged:" not in capsys.readouterr().err


def test_the_final_report_of_a_running_job_counts_the_nodes_that_answer(
        capsys: pytest.CaptureFixture[str]) -> None:
    _daemon(stopped=False)._final_report()  # (nodes found dead meanwhile are not counted)
    assert "staged: 1000 B on 1 nodes" in capsys.readouterr().err


def test_the_final_report_counts_the_pieces_the_nodes_hold(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Nodes whose tiers hold their share in part (partial copies, which their daemons
    serve): the report said only the whole copies ("staged: 0 B on 4 nodes")."""
    d = _daemon(stopped=False)
    node = _node(0)
    node["staging"]["bytes_in_pieces"] = 1000
    d._gather = lambda: [node, _node(1000), None, None]  # type: ignore[method-assign]
    d._final_report()
    assert "staged: 1000 B + 1000 B in pieces on 2 nodes" in capsys.readouterr().err
