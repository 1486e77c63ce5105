"""A cluster with one network namespace per node (separate addresses on a private bridge),
bootstrapped statically: the daemons bind their own address, never 0.0.0.0, and readers
on every node get exactly the origin's bytes. Needs root (``ip netns``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_helpers import (
    make_pack,
    results,
    serve_args,
    start,
    stop,
    tail,
    wait_staged,
    write_expected,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
READER = str(Path(__file__).resolve().parents[1] / "mpi" / "cluster_reader.py")
N = 3
SUBNET = "10.78.31"  # only inside the namespaces this test makes


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture()
def netns() -> Iterator[list[str]]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make network namespaces")
    tag = f"sfs{os.getpid() % 100000}"
    sw, nodes = f"{tag}-sw", [f"{tag}-n{i}" for i in range(N)]
    try:
        _ip("netns", "add", sw)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"network namespaces not permitted here: {exc.stderr.decode().strip()}")
    made = [sw]
    try:
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for i, ns in enumerate(nodes):
            _ip("netns", "add", ns)
            made.append(ns)
            a, b = f"{tag}a{i}", f"{tag}b{i}"
            _ip("link", "add", a, "type", "veth", "peer", "name", b)
            _ip("link", "set", a, "netns", ns)
            _ip("link", "set", b, "netns", sw)
            _ip("-n", sw, "link", "set", b, "master", "br0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", a)
            _ip("-n", ns, "link", "set", a, "up")
        yield nodes
    finally:
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def test_netns_cluster(tmp_path: Path, netns: list[str]) -> None:
    work = str(tmp_path)
    pack, content = make_pack(work, files=80)
    write_expected(work, content)
    with open(os.path.join(work, "hosts"), "w") as f:
        f.write("".join(f"{SUBNET}.{i + 1}:7070\n" for i in range(N)))
    subprocess.run([sys.executable, "-m", "stagefs.cli", "serve", "--new-token",
                    os.path.join(work, "token")], check=True, timeout=60, capture_output=True)
    daemons = [start(["ip", "netns", "exec", ns, *serve_args(
        work, pack, "--hosts", os.path.join(work, "hosts"), "--rank", str(i),
        "--token-file", os.path.join(work, "token"))], os.path.join(work, f"d{i}.log"))
        for i, ns in enumerate(netns)]
    try:
        for i, d in enumerate(daemons):
            wait_staged(work, N, d, timeout=120, log=os.path.join(work, f"d{i}.log"))
        readers = [start(["ip", "netns", "exec", ns, sys.executable, READER, work, "1", str(i)],
                         os.path.join(work, f"r{i}.log")) for i, ns in enumerate(netns)]
        for i, p in enumerate(readers):
            assert p.wait(300) == 0, tail(os.path.join(work, f"r{i}.log"))
        for res in results(work, N):
            assert res["bad"] == 0 and res["origin_bytes"] == 0 and res["peer_bytes"] > 0
        p = subprocess.run(["ip", "netns", "exec", netns[0], sys.executable, "-m", "stagefs.cli",
                            "status", "--runtime", os.path.join(work, "rt0"), "--json"],
                           capture_output=True, text=True, timeout=60)
        nodes = json.loads(p.stdout)["nodes"]
        assert [s["host"] for s in nodes] == [f"{SUBNET}.{i + 1}" for i in range(N)]
    finally:
        codes = [stop(d) for d in daemons]
    assert codes == [0] * N
