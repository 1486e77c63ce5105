"""The static bootstrap (a hosts file and a token file, no MPI): three daemons on loopback,
failover to a replica when a daemon is killed, a restarted daemon reusing its tiers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_helpers import (
    free_ports,
    hosts_daemons,
    make_pack,
    results,
    serve_args,
    start,
    status_json,
    stop,
    tail,
    wait_staged,
    write_expected,
)

pytestmark = pytest.mark.integration
READER = str(Path(__file__).resolve().parents[1] / "mpi" / "cluster_reader.py")




def _daemon(work: str, pack: str, r: int) -> subprocess.Popen[bytes]:
    return start(serve_args(work, pack, "--hosts", os.path.join(work, "hosts"), "--rank", str(r),
                            "--token-file", os.path.join(work, "token"), "--replicas", "2"),
                 os.path.join(work, f"daemon{r}.log"))


def test_static_cluster_failover_and_restart(tmp_path: Path) -> None:
    n = 3
    work = str(tmp_path)
    pack, content = make_pack(work, files=120)
    write_expected(work, content)
    with open(os.path.join(work, "hosts"), "w") as f:
        f.write("# rank 0 first\n" + "".join(f"127.0.0.1:{p}\n" for p in free_ports(n)))
    subprocess.run([sys.executable, "-m", "stagefs.cli", "serve", "--new-token",
                    os.path.join(work, "token")], check=True, timeout=60)
    daemons = [_daemon(work, pack, r) for r in range(n)]
    readers: list[subprocess.Popen[bytes]] = []
    try:
        for r, d in enumerate(daemons):
            wait_staged(work, n, d, log=os.path.join(work, f"daemon{r}.log"))
        st = status_json(work, 2)
        assert all(s["bootstrap"] == "static" for s in st["nodes"])
        readers = [start([sys.executable, READER, work, "6", str(r)],
                         os.path.join(work, f"reader{r}.log")) for r in range(n)]
        deadline = time.monotonic() + 60
        while not all(os.path.exists(os.path.join(work, f"reading{r}")) for r in range(n)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with open(os.path.join(work, "rt1", "cluster.json")) as f:
            assert json.load(f)["pid"] == daemons[1].pid
        daemons[1].send_signal(signal.SIGKILL)  # mid-read
        for r, p in enumerate(readers):
            assert p.wait(300) == 0, tail(os.path.join(work, f"reader{r}.log"))
        for res in results(work, n):
            assert res["bad"] == 0, res
            # every shard has two holders: with one node down the other one serves
            assert res["origin_bytes"] == 0, res
        assert daemons[0].poll() is None and daemons[2].poll() is None
        # the status shows the dead node, and exits 1 for it
        st = status_json(work, 0)
        assert st["nodes"][1] is None

        # restart node 1: it finds its shards in its tiers and reads nothing again
        assert daemons[1].wait(30) == -signal.SIGKILL
        daemons[1] = _daemon(work, pack, 1)
        deadline = time.monotonic() + 60
        while True:
            st = status_json(work, 0)
            s1 = st["nodes"][1]
            if s1 is not None and s1["state"] == "staged":
                break
            assert time.monotonic() < deadline, tail(os.path.join(work, "daemon1.log"))
            time.sleep(0.3)
        assert s1["staging"]["shards_reused"] == s1["staging"]["shards_assigned"] > 0
        assert s1["staging"]["origin_bytes"] == 0
        assert s1["staging"]["forwarded_bytes"] == 0
    finally:
        for p in readers:
            stop(p)
        codes = [stop(d) for d in daemons]
    assert codes == [0, 0, 0], [tail(os.path.join(work, f"daemon{r}.log")) for r in range(n)]


def test_serve_errors_are_clear(tmp_path: Path) -> None:
    work = str(tmp_path)
    cli = [sys.executable, "-m", "stagefs.cli", "serve"]
    p = subprocess.run([*cli, work, "--tier", work + "/t"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 1 and "not a pack" in p.stderr
    pack, _ = make_pack(work, files=5)
    with open(os.path.join(work, "hosts"), "w") as f:
        f.write("127.0.0.1:1\n")
    p = subprocess.run([*cli, pack, "--tier", work + "/t", "--hosts", work + "/hosts",
                        "--rank", "0"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "--token-file" in p.stderr
    p = subprocess.run([*cli, pack, "--tier", work + "/t", "--hosts", work + "/hosts",
                        "--rank", "3", "--token-file", "x"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 1 and "not a line of the hosts file" in p.stderr
    p = subprocess.run([*cli, pack, "--tier", work + "/t", "--bind", "0.0.0.0"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "all interfaces" in p.stderr
    import stagefs
    from stagefs.errors import ClusterError

    with pytest.raises(ClusterError, match="stagefs serve"):
        stagefs.connect(os.path.join(work, "nothing"))


def test_tiers_too_small_for_the_shards_end_staging_at_once(tmp_path: Path) -> None:
    """Two nodes whose tiers hold none of their shards: each waited for the other's copies
    of its second replicas, which would never exist, until the forward timeout (10
    minutes; `stagefs status --wait-staged` and `serve --wait` with it). Now a node whose
    tiers are full, or a shard whose primary finished its own shards without it, is done
    with at once; the readers read the origin."""
    import stagefs

    n, work = 2, str(tmp_path)
    pack, content = make_pack(work, files=60, shard_size="1MiB")
    daemons = hosts_daemons(work, pack, n, "512KiB", "--replicas", "2")
    try:
        for r, d in enumerate(daemons):  # (the forward timeout is 600 s)
            wait_staged(work, n, d, timeout=120, log=os.path.join(work, f"daemon{r}.log"))
        st = status_json(work, 0)
        assert all(s is not None and s["staging"]["no_room"] > 0 for s in st["nodes"]), st
        with stagefs.connect(os.path.join(work, "rt0")) as fs:
            for path, data in content.items():
                assert fs.read(path) == data
    finally:
        codes = [stop(d) for d in daemons]
    assert codes == [0, 0], [tail(os.path.join(work, f"daemon{r}.log")) for r in range(n)]


def test_shards_their_primaries_could_not_copy_end_staging_at_once(tmp_path: Path) -> None:
    """Every shard bad at the origin: each primary refuses its copies, and its second
    holder waited for them (and the primary, staging its own second copies, for the
    other's) until the forward timeout. A primary done with its own shards without one
    now means that shard will not come from it."""
    n, work = 2, str(tmp_path)
    pack, _ = make_pack(work, files=60, shard_size="128KiB")
    for name in os.listdir(pack):
        if name.startswith("shard-"):
            with open(os.path.join(pack, name), "r+b") as f:
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 0xFF]))
    with open(os.path.join(work, "hosts"), "w") as f:
        f.write("".join(f"127.0.0.1:{p}\n" for p in free_ports(n)))
    subprocess.run([sys.executable, "-m", "stagefs.cli", "serve", "--new-token",
                    os.path.join(work, "token")], check=True, timeout=60)
    daemons = [_daemon(work, pack, r) for r in range(n)]
    try:
        for r, d in enumerate(daemons):  # (the forward timeout is 600 s)
            wait_staged(work, n, d, timeout=120, log=os.path.join(work, f"daemon{r}.log"))
        st = status_json(work, 0)
        for s in st["nodes"]:
            assert s is not None and s["state"] == "staged", st
            assert s["staging"]["checksum_failures"] > 0
            assert s["staging"]["shards_held"] < s["staging"]["shards_assigned"]
    finally:
        codes = [stop(d) for d in daemons]
    assert codes == [0, 0], [tail(os.path.join(work, f"daemon{r}.log")) for r in range(n)]
