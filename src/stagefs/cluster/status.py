"""``stagefs status`` for a cluster: ask every daemon (STATUS over the protocol), one table,
then a line per node that has seen a node die: its re-replication (cluster/rereplicate.py).

A node's "checksum failures" are its staging's (files copied bad: ``checksum_failures``)
and its processes' reads' (``reads.checksum_failures``, the counters its daemon sums from
the node's runtime directory, as ``--json``'s ``reads`` sums this node's)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from stagefs.cluster.bootstrap import placed
from stagefs.cluster.cmap import (
    MAP_NAME,
    ClusterMap,
    check_runtime_access,
    daemon_ended,
    load_runtime,
    map_left,
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

__all__ = ["checksum_failures", "cluster_status", "has_cluster", "placed_apart",
           "print_cluster_status", "rereplication_lines", "said_unreadable", "unreadable",
           "wait_for_cluster", "without_room"]

log = logging.getLogger("stagefs.status")


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
            info = c.status()
        except SourceUnavailable:
            return None
        finally:
            c.close()
        why = unreadable(info)
        if why is not None:
            said_unreadable(n, why)
            return None
        return info

    with ThreadPoolExecutor(max_workers=min(32, max(1, cmap.size))) as ex:
        nodes = list(ex.map(ask, enumerate(cmap.nodes)))
    return cmap, nodes


_NUMBERS = {"staging": ("shards_held", "shards_assigned", "bytes_held", "bytes_assigned",
                        "origin_bytes", "forwarded_bytes", "started", "finished",
                        "checksum_failures"),
            "server": ("bytes_served",), "": ("checksum_failures", "peers_unreachable")}


def unreadable(info: object) -> str | None:
    """Why a peer's STATUS cannot be read as a daemon's (what is missing, or of the wrong
    kind), None if it can: the reports and ``stagefs status`` read it. One from a peer of
    another stagefs, or not a daemon of this job, ended rank 0's daemon at its final report
    (a KeyError) and ``stagefs status`` with a traceback."""
    if not isinstance(info, dict):
        return "not an object"
    if not isinstance(info.get("state"), str) or not isinstance(info.get("tiers"), list):
        return "no state or tiers"
    for part, keys in _NUMBERS.items():
        d = info.get(part) if part else info
        if not isinstance(d, dict):
            return f"no {part}"
        for k in keys:
            if not isinstance(d.get(k), int | float) or isinstance(d.get(k), bool):
                return f"no number {(part + '.') if part else ''}{k}"
    if not all(isinstance(t, dict) and isinstance(t.get("used"), int) for t in info["tiers"]):
        return "a tier without its use"
    r = info.get("rereplication")
    if r is not None and not (isinstance(r, dict) and isinstance(r.get("dead"), list)):
        return "a rereplication without its dead nodes"
    return None


def said_unreadable(node: int, why: str) -> None:
    log.warning("node %d answered a STATUS this stagefs cannot read (%s): every node of a "
                "job must run the same stagefs (and a daemon of this job at each address); "
                "shown as unreachable", node, why)


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
    pieces = int(st.get("bytes_in_pieces", 0))  # of shards held in part (served too)
    others = int(st.get("bytes_for_others", 0))  # pieces of shards whose holders are full
    share = (f"{st['shards_held']}/{st['shards_assigned']} shards, "
             f"{format_size(st['bytes_held'])} "
             + (f"+ {format_size(pieces)} in pieces " if pieces else "")
             + f"({(st['bytes_held'] + pieces) / max(1, st['bytes_assigned']):.0%})"
             + (f", + {format_size(others)} of others' shards" if others else ""))
    tiers = ", ".join(f"{format_size(t['used'])}/"
                      f"{'free' if t['capacity'] is None else format_size(t['capacity'])}"
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
    short = sum(int(s["rereplication"].get("no_room", 0)) for s in nodes
                if s and s.get("rereplication") and not s["rereplication"]["isolated"])
    if short:  # each node said it on its line, but not what it costs the job
        out.append(f"{short} shard copies of the dead nodes were not made again: no room on "
                   "the nodes that take them over; those shards have fewer than the "
                   f"{replicas} copies asked (their reads go to the copies left, or the "
                   "origin). Give the nodes' tiers more room, or the job more nodes")
    return out


def without_room(nodes: list[dict[str, Any] | None], replicas: int) -> str | None:
    """The shard copies placed on nodes whose tiers had no room for them (their staging
    over): how many, on which nodes, and where their reads go; None if every node took its
    share. Each node's own share ("3/11 shards") was all there was, and rank 0's summary
    gave the origin bytes read as a share of the dataset, which made a cluster too small
    for the dataset look thrifty (0.44x: the rest was never staged, and is read from the
    origin every epoch)."""
    short: dict[int, tuple[int, int]] = {}
    for n, s in enumerate(nodes):
        st = s["staging"] if s and s.get("staging_done") else None
        if st and st.get("no_room"):
            short[n] = (st["shards_assigned"] - st["shards_held"],
                        st["bytes_assigned"] - st["bytes_held"])
    if not short:
        return None
    copies = sum(c for c, _ in short.values())
    where = ", ".join(f"node {n} ({c})" for n, (c, _) in sorted(short.items()))
    others = sum(s["staging"].get("bytes_for_others", 0) for s in nodes if s)
    spares = ("the pieces the shards' spares hold in the room they have left after "
              f"staging ({format_size(others)} so far)")
    cost = ("with --replicas 1 they have no other holder (a --replicate-all shard "
            "aside): their reads go to the origin, but for the pieces those nodes' tiers "
            f"hold of them (partial copies) and {spares}" if replicas == 1 else
            "their reads go to their other holders, or the origin where none took them "
            f"(but for the pieces those nodes' tiers hold of them and {spares})")
    return (f"{copies} shard copies ({format_size(sum(b for _, b in short.values()))}) "
            f"placed on nodes whose tiers had no room for them: {where}; {cost}. Give "
            "those nodes' tiers more room, or the job more nodes (placement does not "
            "weigh the nodes' room: docs/cluster.md)")


def print_cluster_status(runtime: str | None, *, as_json: bool = False,
                         wait_staged: float | None = None) -> int:
    """Print the cluster's state; with ``wait_staged``, first wait (up to that many seconds)
    until every node has staged. Exit code 0 if every node answered (and staged, if asked)."""
    deadline = time.monotonic() + (wait_staged or 0)
    path = os.path.abspath(runtime) if runtime else runtime_default()
    while True:
        cmap, nodes = cluster_status(runtime)
        mine = nodes[cmap.rank] if 0 <= cmap.rank < len(nodes) else None
        gone = map_left(path, cmap) if mine is None else None
        if gone is not None:  # (every node shown unreachable, --wait-staged waited it out)
            raise ClusterError(gone)
        staged = all_staged(nodes)
        if wait_staged is None or staged or time.monotonic() >= deadline:
            break
        time.sleep(1.0)
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
        roomless = without_room(nodes, cmap.replicas)
        if roomless:
            print(roomless)
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
    for line in placed_apart(nodes):
        print(line, file=sys.stderr)
    if wait_staged is not None:
        if not staged:
            print("not every node has staged yet", file=sys.stderr)
            return 1
        return 0  # staged: every node, but those found dead whose shards were copied again
    return 0 if not down else 1


def placed_apart(nodes: list[dict[str, Any] | None]) -> list[str]:
    """The nodes that place the shards with other settings than the others (a daemon
    restarted with another --replicas, --seed or --replicate-all): a line for each group,
    then what to do; none when they all agree."""
    groups: dict[str, list[int]] = {}
    said: dict[str, dict[str, Any]] = {}
    for n, s in enumerate(nodes):
        p = (s or {}).get("placement")
        if isinstance(p, dict) and p.get("key"):
            groups.setdefault(str(p["key"]), []).append(n)
            said[str(p["key"])] = p
    if len(groups) < 2:
        return []
    return [*(f"node(s) {', '.join(map(str, ns))} place the shards with {placed(said[k])}"
              for k, ns in sorted(groups.items(), key=lambda g: -len(g[1]))),
            "the nodes do not agree on who holds which shard (reads of the others' shards "
            "go to a peer that does not hold them, or the origin): every daemon of a job "
            "must be given the same --replicas, --seed and --replicate-all; restart the "
            "odd ones with the others' arguments"]


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
