"""Choosing the daemons' peer transport (cluster/transport.py): the errors that say what to
do when the MPI transport cannot be used. The MPI jobs themselves are in tests/mpi."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stagefs.cluster.daemon import ServeOptions, serve
from stagefs.errors import ConfigError

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_serve_mpi_transport_without_mpi4py_says_what_to_install(tmp_path: Path) -> None:
    # mpi4py made unimportable in the child, as on a node where it is not installed
    code = ("import sys; sys.modules['mpi4py'] = None; from stagefs.cli import main; "
            f"sys.exit(main(['serve', {str(tmp_path)!r}, '--tier', "
            f"{str(tmp_path / 'mem')!r}, '--transport', 'mpi']))")
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert run.returncode == 1, run.stderr
    assert "--transport mpi was given but MPI cannot be used" in run.stderr
    assert "pip install 'stagefs[mpi]'" in run.stderr and "--transport tcp" in run.stderr


@pytest.mark.parametrize("extra", [{"hosts": "hosts.txt"}, {"mpi": False}])
def test_mpi_transport_needs_mpi_ranks(tmp_path: Path, extra: dict[str, object]) -> None:
    o = ServeOptions(origin=str(tmp_path), tiers=[str(tmp_path / "mem")], transport="mpi",
                     **extra)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="launch the daemons as MPI ranks"):
        serve(o)


def test_unknown_transport_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="use one of tcp, mpi"):
        serve(ServeOptions(origin=str(tmp_path), tiers=[str(tmp_path)], transport="ib"))


def _node(transport: str) -> dict[str, object]:
    """The STATUS of a staged node, as much as the status table reads."""
    return {"host": "10.0.0.1", "port": 7070, "state": "staged", "transport": transport,
            "staging": {"shards_held": 2, "shards_assigned": 2, "bytes_assigned": 10,
                        "bytes_held": 10},
            "tiers": [], "server": {"bytes_served": 5, "tcp_peers": 1},
            "peers_unreachable": 0, "checksum_failures": 0, "reads": {},
            "mpi": {"server": {"bytes_served": 7}} if transport == "mpi" else None}


@pytest.mark.parametrize("transport", ["tcp", "mpi"])
def test_status_says_which_peer_transport_the_job_runs_on(
        transport: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    # which transport a job's daemons use was said only by --json, while the text's
    # "served" column sums the MPI server's bytes with the TCP server's
    from stagefs.cluster import status
    from stagefs.cluster.cmap import ClusterMap

    cmap = ClusterMap(pack=str(tmp_path / "pack"), pack_id="00", rank=0,
                      nodes=[("10.0.0.1", 7070), ("10.0.0.2", 7070)], replicas=2, seed=0,
                      everywhere=[], replicate_all=[], tiers=[])
    nodes: list[dict[str, object] | None] = [_node(transport), None]
    monkeypatch.setattr(status, "cluster_status", lambda runtime: (cmap, nodes))
    status.print_cluster_status(str(tmp_path))
    head = capsys.readouterr().out.splitlines()[0]
    assert head.endswith(f"(replicas 2, peer transport {transport})"), head
