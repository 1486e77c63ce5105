"""``stagefs status`` for a cluster: ask every daemon (STATUS over the protocol), one table,
then a line per node that has seen a node die: its re-replication (cluster/rereplicate.py).

A node's "checksum failures" are its staging's (files copied bad: ``checksum_failures``)
and its processes' reads' (``reads.checksum_failures``, the counters its daemon sums from
the node's runtime directory, as ``--json``'s ``reads`` sums this node's)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from stagefs.cluster.cmap import (
    MAP_NAME,
    ClusterMap,
    check_runtime_access,
    daemon_ended,
    load_runtime,
)
from stagefs.cluster.world import runtime_default
from stagefs.config import format_size
from stagefs.errors import ClusterError
from stagefs.net.client import PeerClient
from stagefs.net.sockio import host_port
from stagefs.tiers.base import SourceUnavailable
from stagefs.tiers.status import (
    holder_summary,
    read_counts,
    read_lines,
    stall_lines,
    stall_records,
)

__all__ = ["checksum_failures", "cluster_status", "has_cluster", "print_cluster_status",
           "rereplication_lines", "wait_for_cluster"]


def has_cluster(runtime: str | None) -> bool:
    """Does a cluster daemon's map sit in ``runtime``? Raises ClusterError, naming the
    directory's owner, for a directory this user cannot enter (its map could not be seen:
    status went on to the single-node one and failed on a file in it)."""
    path = os.path.abspath(runtime) if runtime else runtime_default()
    check_runtime_access(path)
    return os.path.exists(os.path.join(path, MAP_NAME))


def cluster_status(runtime: str | None, timeout: float = 3.0
                   ) -> tuple[ClusterMap, list[dict[str, Any] | None]]:
    """The cluster map of this node's runtime and every node's STATUS (None: unreachable)."""
    path = os.path.abspath(runtime) if runtime else runtime_default()
    cmap, token = load_runtime(path)
    pack_id = bytes.fromhex(cmap.pack_id)

    def ask(node: tuple[int, tuple[str, int]]) -> dict[str, Any] | None:
        n, (host, port) = node
        c = PeerClient(host, port, token, pack_id=pack_id, timeout=timeout,
                       connect_timeout=timeout, name=f"node {n}")
        try:
            return c.status()
        except SourceUnavailable:
            return None
        finally:
            c.close()

    with ThreadPoolExecutor(max_workers=min(32, max(1, cmap.size))) as ex:
        nodes = list(ex.map(ask, enumerate(cmap.nodes)))
    return cmap, nodes


def _refusing(nodes: list[dict[str, Any] | None]) -> dict[int, str]:
    """The nodes the others say refuse their handshake: another job token, or another
    pack (a misconfiguration, not a crash: said apart from unreachable)."""
    out: dict[int, str] = {}
    for s in nodes:
        r = (s or {}).get("rereplication") or {}
        out.update({int(n): "refuses the job token" for n in r.get("refused_token", ())})
        out.update({int(n): "serves another pack" for n in r.get("other_pack", ())})
    return out


def _row(n: int, cmap: ClusterMap, s: dict[str, Any] | None,
         refusing: dict[int, str] | None = None) -> list[str]:
    addr = host_port(*cmap.nodes[n])
    if s is None:
        state = (refusing or {}).get(n, "unreachable")
        return [str(n), addr, state, "-", "-", "-", "-", "-", "-", "-"]
    st = s["staging"]
    share = (f"{st['shards_held']}/{st['shards_assigned']} shards, "
             f"{format_size(st['bytes_held'])} "
             f"({st['bytes_held'] / max(1, st['bytes_assigned']):.0%})")
    tiers = ", ".join(f"{format_size(t['used'])}/"
                      f"{format_size(t['capacity']) if t['capacity'] else 'free'}"
                      for t in s["tiers"])
    srv = s["server"]
    # TCP: its peers' connections, not the one this status request came on
    conns = (f"{max(0, srv.get('tcp_peers', 0) - 1)}/{srv.get('unix_readers', 0)}/"
             f"{srv.get('refused_busy', 0)}")
    relayed = (f"{srv.get('relayed_ranges', 0):,} ({srv.get('relayed_missing', 0):,} "
               "to the origin)")
    mpi = (s.get("mpi") or {}).get("server") or {}  # --transport mpi: its staging copies
    served = srv["bytes_served"] + int(mpi.get("bytes_served", 0))
    return [str(n), addr, s["state"], share, tiers, format_size(served), conns,
            relayed, _unreachable(s), str(checksum_failures(s))]


def checksum_failures(s: dict[str, Any]) -> int:
    """A node's files that failed their checksum: copied by its staging, and read by its
    processes (``reads``: its readers', as ``--json`` counts them for this node)."""
    return int(s["checksum_failures"]) + int((s.get("reads") or {}).get("checksum_failures", 0))


def _unreachable(s: dict[str, Any]) -> str:
    """The peers this node skips now (suspect), and its failed contacts so far (they count
    the peers still starting when the cluster came up: not a fault)."""
    now = len((s.get("fabric") or {}).get("suspect_peers", ()))
    return f"{now} ({s['peers_unreachable']} failed contacts)"


def rereplication_lines(nodes: list[dict[str, Any] | None], replicas: int = 1) -> list[str]:
    """What re-replication did: the dead nodes each node sees, the shards it copies again,
    and where the bytes came from (peers, or the origin when no replica survived); and
    when fewer nodes live than ``replicas``, that the job has fewer copies than asked."""
    out = []
    live = sum(s is not None for s in nodes)
    dead = max((len(s["rereplication"]["dead"]) for s in nodes
                if s and s.get("rereplication")), default=0)
    live = min(live, len(nodes) - dead)
    if 0 < live < replicas:
        out.append(f"{live} of {len(nodes)} nodes live: each shard has at most {live} "
                   f"copies, not the {replicas} asked (--replicas)")
    for n, s in enumerate(nodes):
        r = s.get("rereplication") if s else None
        if not r or not (r["dead"] or r["generation"]):
            continue
        state = "cut off: copies nothing" if r["isolated"] else (
            "done" if r["done"] else "copying")
        out.append(
            f"node {n}: dead nodes {r['dead'] or 'none'} (generation {r['generation']}); "
            f"re-replication {state}: {r['shards_copied']}/{r['shards_to_copy']} shards "
            f"copied for the dead nodes now ({r['shards_held_already']} held already); "
            f"since the job began {format_size(r['from_peers_bytes'])} copied from peers, "
            f"{format_size(r['from_origin_bytes'])} from the origin"
            + (f", {r['no_room']} without room" if r["no_room"] else ""))
    return out


def print_cluster_status(runtime: str | None, *, as_json: bool = False,
                         wait_staged: float | None = None) -> int:
    """Print the cluster's state; with ``wait_staged``, first wait (up to that many seconds)
    until every node has staged. Exit code 0 if every node answered (and staged, if asked)."""
    deadline = time.monotonic() + (wait_staged or 0)
    while True:
        cmap, nodes = cluster_status(runtime)
        staged = all_staged(nodes)
        if wait_staged is None or staged or time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    path = os.path.abspath(runtime) if runtime else runtime_default()
    reads = holder_summary(read_counts(os.path.join(path, "stats")))  # this node's processes
    stalls = stall_records(path)  # this node's training processes' (StallMeter)
    if as_json:
        print(json.dumps({"pack": cmap.pack, "nodes": nodes, "reads": reads,
                          "stalls": stalls}, indent=1, sort_keys=True))
    else:
        head = ["node", "address", "state", "staged share", "tier use", "served",
                "tcp/unix/refused", "relayed for readers", "peers unreachable now",
                "checksum failures"]
        refusing = _refusing(nodes)
        rows = [head] + [_row(n, cmap, s, refusing) for n, s in enumerate(nodes)]
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        print(f"cluster of {cmap.size} nodes serving {cmap.pack} "
              f"(replicas {cmap.replicas}{', replicate-all ' + ' '.join(cmap.replicate_all) if cmap.replicate_all else ''}"
              f"{_transport(nodes)})")
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        for line in rereplication_lines(nodes, cmap.replicas):
            print(line)
        for line in read_lines(reads, "this node's processes: readers, the daemon"):
            print(line)
        for line in stall_lines(stalls):
            print(line)
    down = sum(s is None for s in nodes)
    if down:
        print(f"{down} node(s) unreachable: reads of their shards go to replicas or the "
              "origin", file=sys.stderr)
    refused = sorted(n for n in _refusing(nodes) if nodes[n] is None)
    if refused:
        print(f"node(s) {', '.join(map(str, refused))} refuse the others' handshake: "
              "every node of the job must use the same job token (the same --token-file, "
              "or under Slurm the same $STAGEFS_SECRET) and the same pack", file=sys.stderr)
    if wait_staged is not None:
        if not staged:
            print("not every node has staged yet", file=sys.stderr)
            return 1
        return 0  # staged: every node, but those found dead whose shards were copied again
    return 0 if not down else 1


def _transport(nodes: list[dict[str, Any] | None]) -> str:
    """The peer transport the live nodes say they use (``--transport``), for the header:
    which one a job runs on was said only by ``--json``, and the "served" column sums
    both (a node's MPI server's bytes with its TCP server's)."""
    used = sorted({str(s["transport"]) for s in nodes if s and s.get("transport")})
    return f", peer transport {'/'.join(used)}" if used else ""


def all_staged(nodes: list[dict[str, Any] | None]) -> bool:
    """Has every node staged? A node that does not answer and that the others found dead
    is not waited for once they have copied its shards again (it may have died before it
    staged: the cluster is staged without it)."""
    live = [s for s in nodes if s is not None]
    if not live or not all(s.get("state") == "staged" for s in live):
        return False
    dead: set[int] = set()
    for s in live:
        r = s.get("rereplication") or {}
        dead.update(r.get("dead", ()))
        if r and not r.get("done"):
            return False  # still copying the dead nodes' shards
    return all(s is not None or n in dead for n, s in enumerate(nodes))


def wait_for_cluster(runtime: str | None, seconds: float,
                     clock: Callable[[], float] = time.monotonic,
                     sleep: Callable[[float], None] = time.sleep) -> float:
    """Wait up to ``seconds`` for this node's daemon to write its runtime (a job script
    that starts the daemons in the background asks at once); return the time left. A
    ClusterError, at once, if the daemon failed at start or has ended (it never will)."""
    path = os.path.abspath(runtime) if runtime else runtime_default()
    deadline = clock() + seconds
    while not has_cluster(runtime) and clock() < deadline:
        why = daemon_ended(path)
        if why is not None:
            raise ClusterError(why)
        sleep(min(0.5, max(deadline - clock(), 0.0)))
    return max(deadline - clock(), 0.0)
