"""World discovery from launcher variables, hosts files, the runtime map: pure parts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stagefs.cluster.cmap import ClusterMap, load_runtime, write_map
from stagefs.cluster.world import detect, job_id, read_hosts, runtime_default, under_mpi
from stagefs.errors import ClusterError, ConfigError


def test_detect_from_launchers() -> None:
    w = detect({"PMI_RANK": "2", "PMI_SIZE": "4"})
    assert (w.rank, w.size) == (2, 4)
    assert detect({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3"}).source == "mpi"
    w = detect({"SLURM_PROCID": "5", "SLURM_NTASKS": "8"})
    assert (w.rank, w.size, w.source) == (5, 8, "slurm")
    w = detect({"RANK": "1", "WORLD_SIZE": "2"})
    assert (w.rank, w.size, w.source) == (1, 2, "torchrun")
    assert detect({"RANK": "9", "WORLD_SIZE": "2"}).source == "single"  # inconsistent: ignored
    assert detect({}).size == 1
    assert under_mpi({"PMI_RANK": "0"}) and not under_mpi({"RANK": "0"})


def test_hosts_file(tmp_path: Path) -> None:
    p = tmp_path / "hosts"
    p.write_text("# nodes\n10.0.0.1:7000\nnode2\n[fe80::1]:7001  # v6\n\n")
    assert read_hosts(str(p)) == [("10.0.0.1", 7000), ("node2", None), ("fe80::1", 7001)]
    p.write_text("a:99999\n")
    with pytest.raises(ConfigError, match="bad port"):
        read_hosts(str(p))
    p.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="names no host"):
        read_hosts(str(p))
    with pytest.raises(ConfigError, match="hosts file"):
        read_hosts(str(tmp_path / "missing"))


def test_runtime_default_is_per_user_and_job(monkeypatch: pytest.MonkeyPatch) -> None:
    assert job_id({"SLURM_JOB_ID": "123"}) == "123"
    assert job_id({"STAGEFS_JOB": "a/b", "SLURM_JOB_ID": "1"}) == "a_b"
    import stagefs.runtime as runtime
    monkeypatch.setattr(runtime, "_launch_session", lambda: 4242)
    assert job_id({}) == "session-4242"
    # a session leader outside our pid namespace (getsid gives 0, as in some containers)
    monkeypatch.setattr(runtime, "_launch_session", lambda: 0)
    assert job_id({}) == "local"
    monkeypatch.undo()
    d = runtime_default({"SLURM_JOB_ID": "77"})
    assert d.endswith(os.path.join(f"stagefs-{os.getuid()}", "77"))
    assert runtime_default({"STAGEFS_RUNTIME": "/x/rt"}) == "/x/rt"


def test_cluster_map_roundtrip(tmp_path: Path) -> None:
    rt = str(tmp_path / "rt")
    cmap = ClusterMap(pack="/p", pack_id="00" * 16, rank=1, nodes=[("127.0.0.1", 1),
                                                                    ("127.0.0.1", 2)],
                      replicas=2, seed=3, everywhere=[0], replicate_all=["val"],
                      tiers=[("/t", None)], staged=True, pid=42)
    write_map(rt, cmap, b"k" * 32)
    assert os.stat(rt).st_mode & 0o777 == 0o700
    got, token = load_runtime(rt)
    assert got == cmap and token == b"k" * 32 and got.size == 2
    (tmp_path / "rt" / "cluster.json").write_text('{"version": 99}')
    with pytest.raises(ClusterError, match="version 99"):
        load_runtime(rt)
    (tmp_path / "rt" / "cluster.json").write_text("{")
    with pytest.raises(ClusterError, match="malformed"):
        load_runtime(rt)


def test_a_hosts_file_naming_one_address_twice_is_refused(tmp_path: Path) -> None:
    """The same ADDR:PORT for two ranks (a line copied, a port left to the default): one
    daemon would be two nodes, and say it staged a cluster of two on its own."""
    from stagefs.cluster.bootstrap import StaticBootstrap
    from stagefs.errors import ClusterError
    from stagefs.net import auth

    token = tmp_path / "token"
    auth.write_token(str(token), auth.new_token())
    p = tmp_path / "hosts"
    p.write_text("127.0.0.1:7000\nnode1\n127.0.0.1:7000\n")
    with pytest.raises(ClusterError, match=r"127\.0\.0\.1:7000 twice \(for ranks 0 and 2\)"):
        StaticBootstrap(read_hosts(str(p)), 0, str(token), 7070)
    p.write_text("node1:7070\nnode1\n")  # the second takes the default port: the same
    with pytest.raises(ClusterError, match="different ports"):
        StaticBootstrap(read_hosts(str(p)), 1, str(token), 7070)
    p.write_text("node1:7000\nnode1:7001\n")  # two daemons on one host, ports of their own
    assert StaticBootstrap(read_hosts(str(p)), 1, str(token), 7070).size == 2
