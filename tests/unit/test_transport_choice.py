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
