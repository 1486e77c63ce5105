"""Cluster staging on the single-node tier layer, and cluster reads through the plain Store:
every staged file verified (from the origin and from a peer), a live process's partial copy
left alone, read_many batched per peer with a per-item fallback. Real files, sockets and
processes."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cluster_helpers import make_pack, serve_args, start, status_json, stop, tail, wait_staged

import stagefs
from conftest import flip_byte
from stagefs.cluster.cmap import ClusterMap, write_map
from stagefs.cluster.daemon import _tier_runtime
from stagefs.cluster.placement import place
from stagefs.cluster.staging import Stager
from stagefs.config import TierSpec
from stagefs.errors import ChecksumError
from stagefs.format import MANIFEST_NAME, Manifest
from stagefs.net import auth
from stagefs.net.client import PeerClient
from stagefs.net.server import ShardServer
from stagefs.tiers.chain import TierChain
from stagefs.tiers.origin import PackOrigin

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, bytes]]:
    return make_pack(str(tmp_path_factory.mktemp("staging")), files=120)


def _files(m: Manifest) -> dict[str, int]:
    return {os.fsdecode(m.path_of(e)): e for e in m.files()}


def _raw_file_inside(m: Manifest) -> int:
    """A raw file of some size that is not the first file of its shard."""
    firsts = {}
    for e in m.files():
        s = int(m.shard[e])
        if s not in firsts or m.offset[e] < m.offset[firsts[s]]:
            firsts[s] = e
    return next(e for e in m.files() if m.codec[e] == 0 and m.size[e] >= 1000
                and e != firsts[int(m.shard[e])])



def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _wait(cond: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _chain(pack: str, m: Manifest, tier: str, runtime: str) -> TierChain:
    """A node's tier chain as the daemon builds it."""
    return TierChain(m, PackOrigin(pack, m), [TierSpec(tier, None)], _tier_runtime(runtime),
                     origin_path=pack)


# -- staging verifies every file --------------------------------------------------------------


def test_a_corrupt_file_at_the_origin_is_never_staged(tmp_path: Path) -> None:
    """Header and size of the shard are right, one byte inside one file is not: the daemon
    does not place the shard, counts and logs it; reads give right bytes or a clear error."""
    work = str(tmp_path)
    pack, content = make_pack(work, files=120)
    m = Manifest(os.path.join(pack, MANIFEST_NAME))
    bad = _raw_file_inside(m)
    shard = int(m.shard[bad])
    name = m.shards[shard].name
    bad_path = os.fsdecode(m.path_of(bad))
    flip_byte(os.path.join(pack, name), int(m.offset[bad]) + int(m.stored[bad]) // 2)
    same_shard = [os.fsdecode(m.path_of(e)) for e in m.files()
                  if int(m.shard[e]) == shard and e != bad]
    log = os.path.join(work, "daemon0.log")
    d = start(serve_args(work, pack, "--bind", "127.0.0.1"), log)
    try:
        wait_staged(work, 1, d, log=log)
        node = status_json(work, 0)["nodes"][0]
        assert node["checksum_failures"] == 1, node
        assert node["staging"]["shards_held"] == len(m.shards) - 1
        held = os.listdir(os.path.join(work, "node0", "mem", m.pack_id.hex()))
        assert name not in held and name + ".partial" not in held
        assert len(held) == len(m.shards) - 1
        text = tail(log, 100_000)
        assert any(name in line and bad_path in line for line in text.splitlines()), text
        fs = stagefs.connect(os.path.join(work, "rt0"))
        with fs:
            with pytest.raises(ChecksumError, match=bad_path):
                fs.read(bad_path)
            assert [fs.read(p) for p in same_shard] == [content[p] for p in same_shard]
            rest = [p for p in content if p != bad_path]
            assert fs.read_many(rest) == [content[p] for p in rest]
    finally:
        code = stop(d)
        m.close()
    assert code == 0, tail(log)


def test_a_bad_file_from_a_peer_is_fetched_from_the_origin(
        packed: tuple[str, dict[str, bytes]], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """Node 1 pulls every shard from node 0, whose copy of one shard has a bad byte inside a
    file: the files before it are kept, the rest comes from the origin, the copy is right."""
    pack, _ = packed
    m = Manifest(os.path.join(pack, MANIFEST_NAME))
    copies = tmp_path / "node0"
    shutil.copytree(pack, copies)
    bad = _raw_file_inside(m)
    shard = int(m.shard[bad])
    name = m.shards[shard].name
    flip_byte(str(copies / name), int(m.offset[bad]) + 1)
    token = auth.new_token()
    srv = ShardServer(m, token, lambda s: str(copies / m.shards[s].name), "127.0.0.1").start()
    peer = PeerClient(*srv.address, token, pack_id=m.pack_id, name="node 0")
    chain = _chain(pack, m, str(tmp_path / "tier1"), str(tmp_path / "rt1"))
    stager = Stager(m, [(0, 1)] * len(m.shards), 1, chain, {0: peer}, threading.Event())
    try:
        with caplog.at_level(logging.WARNING, logger="stagefs"):
            stager.run()
        assert stager.error is None and stager.done.is_set()
        st = stager.stats
        assert st.checksum_failures == 1 and st.forward_fallbacks == 1
        assert st.forwarded_shards == len(m.shards) - 1
        assert st.shards_held == len(m.shards)
        # only what the peer could not give right came from the origin
        assert st.origin_bytes == m.shards[shard].size - int(m.offset[bad])
        for s, sh in enumerate(m.shards):
            got = _read(str(tmp_path / "tier1" / m.pack_id.hex() / sh.name))
            assert got == _read(os.path.join(pack, sh.name)), s
        assert any(name in r.getMessage() and os.fsdecode(m.path_of(bad)) in r.getMessage()
                   and "node 0" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        chain.close()
        peer.close()
        srv.close()
        m.close()


_HOLDER = r"""
import sys
from stagefs.format import Manifest
from stagefs.tiers.claims import Claims
from stagefs.tiers.fill import Extents, create_fill
from stagefs.tiers.placer import Layout

manifest, claims, final, shard = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
m = Manifest(manifest)
assert Claims(claims, m.pack_id.hex()).acquire(shard)
lay = Layout(m)
ext = Extents.of(m, lay.idx[lay.bounds[shard] : lay.bounds[shard + 1]], m.shards[shard].size)
create_fill(final, m.shards[shard].size, ext, shard, m.pack_id)
print("ready", flush=True)
sys.stdin.read()
"""


def test_a_live_process_partial_copy_is_left_alone(packed: tuple[str, dict[str, bytes]],
                                                   tmp_path: Path) -> None:
    """Another process holds the claim on shard 0 and is filling its partial copy: the
    daemon's staging neither deletes nor fills it; once that process is dead, the claim is
    taken over and the copy finished."""
    pack, _ = packed
    m = Manifest(os.path.join(pack, MANIFEST_NAME))
    tier, rt = str(tmp_path / "tier"), str(tmp_path / "rt")
    chain = _chain(pack, m, tier, rt)
    final = os.path.join(tier, m.pack_id.hex(), m.shards[0].name)
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, os.path.join(pack, MANIFEST_NAME),
                               chain.runtime.claims, final, "0"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    stop_event = threading.Event()
    stager = Stager(m, [(0,)] * len(m.shards), 0, chain, {}, stop_event)
    thread = threading.Thread(target=stager.run)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"ready\n"
        inode = os.stat(final + ".partial").st_ino
        thread.start()
        # shard 0 is tried first; every other shard is placed after it
        _wait(lambda: stager.stats.shards_held == len(m.shards) - 1, "the other shards")
        assert os.stat(final + ".partial").st_ino == inode
        assert os.path.exists(final + ".fill") and not os.path.exists(final)
        assert chain.claims.owner(0) is not None and chain.claims.owner(0)[0] == holder.pid
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
        assert stager.done.wait(60) and stager.error is None
        assert _read(final) == _read(os.path.join(pack, m.shards[0].name))
        assert chain.claims.takeovers == 1
        assert not os.path.exists(final + ".partial")
    finally:
        stop_event.set()
        if holder.poll() is None:
            holder.kill()
        holder.wait(30)
        for pipe in (holder.stdin, holder.stdout):
            if pipe is not None:
                pipe.close()
        if thread.is_alive() or stager.done.is_set():
            thread.join(60)
        chain.close()
        m.close()


# -- cluster reads: the Store with peer holders ---------------------------------------------------


class _Cluster:
    """This process is node 0 of three; nodes 1 and 2 are shard servers holding their
    placement's shards (straight from the pack), node 0's tier holds ``local`` shards."""

    def __init__(self, pack: str, work: Path, local: list[int]) -> None:
        self.m = m = Manifest(os.path.join(pack, MANIFEST_NAME))
        self.placement = place(len(m.shards), 3, 2, seed=0)
        token = auth.new_token()
        self.servers = {n: ShardServer(m, token, self._locate(pack, n), "127.0.0.1").start()
                        for n in (1, 2)}
        tier = work / "tier0"
        (tier / m.pack_id.hex()).mkdir(parents=True)
        for s in local:
            shutil.copy(os.path.join(pack, m.shards[s].name), tier / m.pack_id.hex())
        with socket.socket() as sock:  # node 0's own address: nobody dials it
            sock.bind(("127.0.0.1", 0))
            me = sock.getsockname()
        self.runtime = str(work / "rt0")
        write_map(self.runtime, ClusterMap(
            pack=pack, pack_id=m.pack_id.hex(), rank=0,
            nodes=[me, *(self.servers[n].address for n in (1, 2))], replicas=2, seed=0,
            everywhere=[], replicate_all=[], tiers=[(str(tier), None)], staged=True), token)
        self.die_at_first_read: set[int] = set()

    def _locate(self, pack: str, n: int) -> Callable[[int], str | None]:
        def locate(s: int) -> str | None:
            if n in self.die_at_first_read:  # the node dies while answering a batch
                self.die_at_first_read.discard(n)
                self.servers[n].close()
                return None
            return os.path.join(pack, self.m.shards[s].name) if n in self.placement.holders[s] \
                else None

        return locate

    def requests(self) -> dict[int, int]:
        return {n: srv.stats.requests for n, srv in self.servers.items()}

    def close(self) -> None:
        for srv in self.servers.values():
            srv.close()
        self.m.close()


@pytest.fixture()
def cluster(packed: tuple[str, dict[str, bytes]], tmp_path: Path) -> Iterator[_Cluster]:
    pack, _ = packed
    m = Manifest(os.path.join(pack, MANIFEST_NAME))
    mine = [s for s, h in enumerate(place(len(m.shards), 3, 2, seed=0).holders) if 0 in h]
    m.close()
    c = _Cluster(pack, tmp_path, local=mine[:1])
    yield c
    c.close()


def _batch(c: _Cluster, content: dict[str, bytes]) -> list[str]:
    """Non-empty files, two from each shard (a DataLoader batch's worth, well below the
    bytes of one READ request)."""
    seen: dict[int, int] = {}
    out = []
    for p, e in sorted(_files(c.m).items()):
        s = int(c.m.shard[e])
        if 0 < len(content[p]) < 100_000 and seen.get(s, 0) < 2:
            seen[s] = seen.get(s, 0) + 1
            out.append(p)
    return out


def test_read_many_sends_one_request_per_peer(cluster: _Cluster,
                                              packed: tuple[str, dict[str, bytes]]) -> None:
    _, content = packed
    batch = _batch(cluster, content)
    with stagefs.connect(cluster.runtime) as fs:
        assert isinstance(fs, stagefs.Store)
        assert fs.read_many(batch) == [content[p] for p in batch]
        assert cluster.requests() == {1: 1, 2: 1}  # one READ frame each, whatever the items
        assert all(srv.stats.ranges > 1 for srv in cluster.servers.values())
        st = fs.status()
        assert st["mode"] == "cluster" and st["local_hits"] >= 1
        assert st["reads"]["reads"] == len(batch)
        assert st["origin"]["bytes_read"] == 0 and st["unavailable"] == 0


def test_read_many_falls_back_per_item_when_a_peer_dies_mid_batch(
        cluster: _Cluster, packed: tuple[str, dict[str, bytes]]) -> None:
    _, content = packed
    batch = _batch(cluster, content)
    cluster.die_at_first_read.add(1)
    with stagefs.connect(cluster.runtime) as fs:
        assert fs.read_many(batch) == [content[p] for p in batch]
        assert fs.status()["unavailable"] > 0  # node 1's items went to the next holder
        assert cluster.servers[1].stats.requests == 1
        assert fs.status()["suspect_peers"] == [1]
        # node 1 is down now: the next batch goes to node 2, which takes over node 1's
        # shards (the next of their rankings); the ones it has not copied (here it never
        # does) it answers "not held" at once, and they come from the origin
        before = cluster.requests()[2]
        not_held = cluster.servers[2].stats.ranges_not_held
        assert fs.read_many(batch) == [content[p] for p in batch]
        assert cluster.requests()[2] > before
        assert cluster.servers[2].stats.ranges_not_held > not_held
        assert fs.status()["origin"]["bytes_read"] > 0


def test_a_second_daemon_on_a_runtime_in_use_is_refused(tmp_path: Path) -> None:
    """The same `stagefs serve` run twice on one node: the second is refused, naming the
    first (it took over the runtime's map, token and socket, and deleted them when it
    stopped: no reader could reach the first any more); the first serves on. And --rank
    without --hosts is refused (a one-node cluster started instead)."""
    work = str(tmp_path)
    pack, content = make_pack(work, files=40)
    log = os.path.join(work, "daemon0.log")
    d = start(serve_args(work, pack, "--bind", "127.0.0.1"), log)
    try:
        wait_staged(work, 1, d, log=log)
        again = subprocess.run(serve_args(work, pack, "--bind", "127.0.0.1"),
                               capture_output=True, text=True, timeout=120)
        assert again.returncode != 0
        assert f"pid {d.pid}" in again.stderr and "already serves" in again.stderr, again.stderr
        with stagefs.connect(os.path.join(work, "rt0")) as fs:  # the first serves on
            some = sorted(content)[:10]
            assert fs.read_many(some) == [content[p] for p in some]
    finally:
        code = stop(d)
    assert code == 0, tail(log)
    r = subprocess.run([*serve_args(work, pack, "--bind", "127.0.0.1"), "--rank", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--hosts" in r.stderr, r.stderr
    # a --token-file that is not there: said as the daemon's (it asked whether the daemon
    # was running: this is the daemon)
    hosts = os.path.join(work, "hosts1")
    with open(hosts, "w") as f:
        f.write("127.0.0.1:1\n")
    r = subprocess.run([*serve_args(work, pack), "--hosts", hosts, "--rank", "0",
                        "--token-file", os.path.join(work, "no-token")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--new-token" in r.stderr and "running" not in r.stderr
