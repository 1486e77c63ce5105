"""Hosts files a user gets wrong: one daemon under two names, port 0, junk after an IPv6
address. Each was taken silently: a daemon listed as localhost and as 127.0.0.1 counted
itself as two nodes and said it had staged a cluster of two on its own."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from stagefs.cluster.bootstrap import StaticBootstrap, resolve_host
from stagefs.cluster.world import read_hosts
from stagefs.errors import ClusterError, ConfigError
from stagefs.net import auth

# a resolver of our own: no lookup leaves the test
_DNS = {"node1": {"10.0.0.1"}, "node1-ib": {"10.0.0.1"}, "node2": {"10.0.0.2"},
        "10.0.0.1": {"10.0.0.1"}, "10.0.0.2": {"10.0.0.2"}}


def _resolve(host: str, port: int) -> frozenset[tuple[str, int]]:
    return frozenset((ip, port) for ip in _DNS.get(host, ()))


def _token(tmp_path: Path) -> str:
    token = tmp_path / "token"
    auth.write_token(str(token), auth.new_token())
    return str(token)


def _boot(tmp_path: Path, text: str, rank: int = 0) -> StaticBootstrap:
    p = tmp_path / "hosts"
    p.write_text(text)
    return StaticBootstrap(read_hosts(str(p)), rank, _token(tmp_path), 7070, resolve=_resolve)


def test_one_daemon_under_a_name_and_its_ip_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match=r"node1:7000 \(rank 0\) and 10\.0\.0\.1:7000 "
                                           r"\(rank 2\) both reach 10\.0\.0\.1:7000"):
        _boot(tmp_path, "node1:7000\nnode2:7000\n10.0.0.1:7000\n")
    with pytest.raises(ClusterError, match="list each node once"):
        _boot(tmp_path, "node1\nnode1-ib\n", rank=1)  # two names of one host, one port
    # one host, two daemons on ports of their own; names that do not resolve (said when
    # a peer connects to them)
    assert _boot(tmp_path, "node1:7000\n10.0.0.1:7001\nnode2\n").size == 3
    assert _boot(tmp_path, "nowhere1\nnowhere2\n").size == 2


def test_localhost_and_127_0_0_1_are_one_daemon(tmp_path: Path) -> None:
    if ("127.0.0.1", 7000) not in resolve_host("localhost", 7000):
        pytest.skip("localhost does not resolve to 127.0.0.1 here")
    p = tmp_path / "hosts"
    p.write_text("localhost:7000\n127.0.0.1:7000\n")
    with pytest.raises(ClusterError, match="one daemon's address twice"):
        StaticBootstrap(read_hosts(str(p)), 0, _token(tmp_path), 7070)


def test_port_0_and_junk_after_an_ipv6_address_are_refused(tmp_path: Path) -> None:
    p = tmp_path / "hosts"
    for text, why in (("10.0.0.1:0\n", "bad port '0'"),
                      ("[fe80::1]7000\n", "in brackets, the port after them"),
                      ("[fe80::1\n", "in brackets"),
                      ("10.0.0.1 7000\n", "one ADDR\\[:PORT\\] a line")):
        p.write_text(text)
        with pytest.raises(ConfigError, match=why):
            read_hosts(str(p))
    p.write_text("[fe80::1]\n[fe80::2]:7001\n")
    assert read_hosts(str(p)) == [("fe80::1", None), ("fe80::2", 7001)]
    p.write_text("node1\nnode2\n")  # no port on the lines, and --port 0
    with pytest.raises(ClusterError, match="--port 0"):
        StaticBootstrap(read_hosts(str(p)), 0, _token(tmp_path), 0, resolve=_resolve)


def test_the_default_resolver_asks_no_name_service() -> None:
    # IP addresses and loopback names only: every node asking the name service for every
    # other node's name at a job's start would flood it at thousands of nodes
    assert resolve_host("10.1.2.3", 7000) == frozenset({("10.1.2.3", 7000)})
    assert resolve_host("name.that.would.need.dns.example", 7000) == frozenset()


def test_an_ipv6_peer_is_named_in_brackets() -> None:
    from stagefs.net.client import PeerClient
    from stagefs.net.sockio import host_port

    assert host_port("::1", 7070) == "[::1]:7070"
    assert host_port("node1", 7070) == "node1:7070"
    assert PeerClient("fe80::1", 7070, b"t" * 32).name == "[fe80::1]:7070"


def test_the_lines_that_reach_a_daemons_address_are_found_when_asked(tmp_path: Path) -> None:
    # not looked up at start (the flood of every node asking for every name); asked by the
    # daemon that cannot listen at its address, after the failure
    p = tmp_path / "hosts"
    p.write_text("10.0.0.1:7070\nnode2:7070\nnode1:7070\nnode1:7071\n")
    boot = StaticBootstrap(read_hosts(str(p)), 2, _token(tmp_path), 7070,
                           resolve=lambda host, port: frozenset())  # (as at start)
    assert boot.reaching(2, look=_resolve) == [0]  # (not node1:7071: another port)
    assert boot.reaching(1, look=_resolve) == []


def test_a_daemon_whose_address_another_line_holds_is_told_the_hosts_file_names_it_twice(
        tmp_path: Path) -> None:
    # the hosts file names this node by its IP and by its host name: rank 1's daemon could
    # not listen, and said "a daemon of another job, or any program of another user"
    from conftest import pack_files
    from stagefs.cluster.daemon import ServeOptions, serve

    name = socket.gethostname()
    try:
        ip = socket.gethostbyname(name)
    except OSError:
        pytest.skip(f"this host's name {name!r} does not resolve")
    with socket.socket() as held:  # rank 0's daemon, listening at the address
        try:
            held.bind((ip, 0))
        except OSError:
            pytest.skip(f"{name} resolves to {ip}, not an address of this host")
        held.listen(1)
        port = held.getsockname()[1]
        hosts = tmp_path / "hosts"
        hosts.write_text(f"{ip}:{port}\n{name}:{port}\n")
        pack = pack_files(tmp_path, "pack", {"a": b"x" * 100})
        o = ServeOptions(origin=str(pack), tiers=[str(tmp_path / "t1") + ":1MiB"],
                         runtime=str(tmp_path / "rt1"), hosts=str(hosts), rank=1,
                         token_file=_token(tmp_path))
        with pytest.raises(ConfigError, match=rf"names one address twice: rank 0's "
                           rf"{ip}:{port} reaches it"):
            serve(o)
