"""Two nodes of a static job given different job tokens (a common slip: the token file made
again on one node). Each node refuses the other, and each declares the other dead and reads
the whole dataset from the origin, as before; but now each says why, once, naming the peer,
its address and the fix, its status lists the peer as refusing its token (not merely
unreachable), and the refusing side's log holds a few lines, not one per handshake. Before,
the only clue was "peer 127.0.0.1:<ephemeral port> did not prove the job token; refused",
once per handshake, forever."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import make_pack, start, stop, tail

from stagefs.net import auth
from stagefs.net.client import PeerClient, PeerUnavailable

pytestmark = pytest.mark.integration


def _status(port: int, token_file: str) -> dict[str, Any]:
    """The daemon's STATUS, asked with its own token; {} while it does not listen yet."""
    c = PeerClient("127.0.0.1", port, auth.read_token(token_file), timeout=30,
                   connect_timeout=10)
    try:
        return c.status()
    except PeerUnavailable:
        return {}
    finally:
        c.close()


def test_nodes_with_different_tokens_say_so(tmp_path: Path) -> None:
    work = str(tmp_path)
    pack, _ = make_pack(work, files=40, shard_size="128KiB")
    socks = [socket.socket() for _ in range(2)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    with open(os.path.join(work, "hosts"), "w") as f:
        f.write("".join(f"127.0.0.1:{p}\n" for p in ports))
    tokens = [os.path.join(work, f"token{r}") for r in range(2)]
    for t in tokens:
        subprocess.run([sys.executable, "-m", "stagefs.cli", "serve", "--new-token", t],
                       check=True, timeout=60, capture_output=True)
    logs = [os.path.join(work, f"daemon{r}.log") for r in range(2)]
    daemons = [start([sys.executable, "-m", "stagefs.cli", "serve", pack,
                      "--tier", os.path.join(work, f"node{r}", "mem") + ":256MiB",
                      "--runtime", os.path.join(work, f"rt{r}"), "--hosts",
                      os.path.join(work, "hosts"), "--rank", str(r), "--token-file",
                      tokens[r], "--replicas", "2", "--progress", "0", "--dead-after", "2"],
                     logs[r]) for r in range(2)]
    try:
        # each comes to take the other for dead (--dead-after 2), having tried it every
        # second or so meanwhile: the handshakes each refused are counted in its status
        states: list[dict[str, Any]] = []
        for _ in range(1200):  # (a minute at most)
            states = [_status(ports[r], tokens[r]) for r in range(2)]
            if all(s and s["rereplication"]["dead"] and s["state"] == "staged"
                   and s["server"]["auth_failures"] >= 10 for s in states):
                break
            assert all(d.poll() is None for d in daemons), [tail(p) for p in logs]
            time.sleep(0.05)
        for r, s in enumerate(states):
            other = 1 - r
            rr = s["rereplication"]
            assert s["server"]["auth_failures"] >= 10, s
            assert rr["dead"] == [other], s
            assert rr["refused_token"] == [other], rr  # shown apart from a crash
        for r in range(2):
            text = tail(logs[r], 100_000)
            other = 1 - r
            said = [line for line in text.splitlines()
                    if f"node {other} (127.0.0.1:{ports[other]}) refused this node's job "
                    "token" in line]
            assert len(said) == 1, text  # once per peer, not once per probe
            assert "same token" in said[0] and "--token-file" in said[0]
            assert "not crashed" in text  # the dead-set line says why
            # the refusing side: a few lines, not one per failed handshake
            refused = [line for line in text.splitlines() if "did not prove the job token" in
                       line or "failed authentication" in line]
            assert len(refused) <= 4, refused
        # `stagefs status`, as a user reads it: the other node refuses, not "unreachable"
        st = subprocess.run([sys.executable, "-m", "stagefs.cli", "status", "--runtime",
                             os.path.join(work, "rt0")], capture_output=True, text=True,
                            timeout=60)
        row = [line for line in st.stdout.splitlines() if line.startswith("1 ")]
        assert row and "refuses the job token" in row[0], st.stdout
        assert "node(s) 1 refuse the others' handshake" in st.stderr, st.stderr
        assert "same job token" in st.stderr
    finally:
        codes = [stop(d) for d in daemons]
    assert codes == [0, 0], [tail(p) for p in logs]
