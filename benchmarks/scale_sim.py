"""A discrete-event model of a stagefs job at scale (SimPy): staging, then epochs, with and
without a node lost mid-epoch. It replaces the old analytic scale model, which modelled I/O
only, ignored prefetch depth and, re-run, said 100% at any size (it modelled nothing that
limits).

What is modelled (each a SimPy resource or process):
- **Links.** Every node has an outgoing and an incoming link of ``link_Bps`` (FIFO, one
  transfer at a time per direction: tc's tbf behaves so); a transfer holds the sender's out
  and the receiver's in together, plus one-way latency. Transfers never wait on a link
  while holding another in a cycle (out is always taken first), so no deadlock.
- **Daemons.** One event loop per node (capacity 1): each request served costs
  ``req_s + bytes * byte_s`` of it; each batch a reader relays through it ``relay_s``.
- **The origin (shared file system).** A shared pipe of ``pfs_Bps`` with ``pfs_streams``
  at once and ``pfs_open_s`` per shard opened (the metadata server's round trip).
- **Staging.** Shards are placed by rendezvous hashing (placement.py's rule, the same
  code): each shard's primary reads it from the origin (one stager per node, in order),
  the other holders copy it from the primary over the links once it has it.
- **Readers.** One per node: each epoch, its slice of a seeded global shuffle, in batches;
  ``prefetch`` batches in flight; a batch's samples held on the node cost ``local_s`` each
  in the reader, the others are split per holder (the less busy of two of the K, by
  requests in flight) and fetched in parallel through the node's daemon; then the step
  computes for ``compute_s``. Nodes start each epoch together (the all-reduce holds them):
  the job's epoch time is its slowest node's.
- **A lost node.** At ``kill_at`` of an epoch the node's daemon stops answering: requests
  already sent to it and new ones wait ``hedge_s`` and go to the next holder (another
  replica, or the origin if none); the survivors re-replicate its shards from the replicas
  over the links (background traffic, competing with reads). Its reader goes on (its tier
  files are still there), reading remote samples straight from the holders.

Calibration: every constant comes from measurements on the emulated cluster
(benchmarks/emucluster.py ``--calibrate`` writes them); validation: the model predicts the
emulated runs at 32 and 64 nodes, compared side by side with what was measured (docs/scale.md).

    python benchmarks/scale_sim.py --calibration benchmarks/results/emulated.json \\
        --nodes 32 64 512 1024 4096 --kill
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections.abc import Generator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import simpy

from stagefs.cluster.placement import place  # the placement the daemons use


@dataclass(frozen=True)
class Params:
    # the workload (per node: weak scaling)
    samples_per_node: int = 128
    sample_bytes: int = 64 * 1024
    shard_bytes: int = 4 * 2**20
    batch: int = 4
    compute_s: float = 0.2
    prefetch: int = 4
    epochs: int = 2
    replicas: int = 2
    # calibrated
    link_Bps: float = 20e6 / 8
    latency_s: float = 0.0002  # one way, per message
    req_s: float = 0.0002  # daemon event loop per request served
    byte_s: float = 1e-10  # and per byte served
    relay_s: float = 0.0003  # per reader batch relayed through the node's daemon
    # a sample read from the node's own tier, in the reader: warm Store.read of 110 KB
    # samples ran at 25-30 k/s here (benchmarks/results/foundation.json)
    local_s: float = 0.000035
    reader_batch_s: float = 0.0003  # the reader's own cost per batch (lookups, verify)
    host_cores: int | None = None  # the emulation: every node's CPU work on these cores
    pfs_Bps: float = 100e6
    pfs_streams: int = 8
    pfs_open_s: float = 0.002
    hedge_s: float = 0.5
    chunk_bytes: int = 64 * 1024  # the grain at which transfers sharing a link interleave
    # a lost node
    kill_at: float | None = None  # fraction of the last epoch
    seed: int = 0

    def shards(self, n: int) -> int:
        per_shard = max(1, self.shard_bytes // self.sample_bytes)
        return -(-n * self.samples_per_node // per_shard)


@dataclass
class Outcome:
    nodes: int
    staging_s: float = 0.0
    staging_origin_bytes: int = 0
    epochs_s: list[float] = field(default_factory=list)
    origin_fallback_bytes: int = 0
    rereplicated_bytes: int = 0


class Sim:
    def __init__(self, n: int, p: Params) -> None:
        self.n, self.p = n, p
        self.env = simpy.Environment()
        self.out = [simpy.Resource(self.env, 1) for _ in range(n)]
        self.inl = [simpy.Resource(self.env, 1) for _ in range(n)]
        self.loop = [simpy.Resource(self.env, 1) for _ in range(n)]
        self.pfs = simpy.Resource(self.env, p.pfs_streams)
        self.host = simpy.Resource(self.env, p.host_cores) if p.host_cores else None
        self.rng = random.Random(p.seed)
        self.nshards = p.shards(n)
        self.placement = place(self.nshards, n, p.replicas, seed=p.seed)
        self.inflight = [0] * n
        self.hedged_parts = 0
        self.dead: int | None = None
        self.dead_at = float("inf")
        self.res = Outcome(n)
        self.per_shard = max(1, p.shard_bytes // p.sample_bytes)

    def cpu(self, seconds: float) -> Generator[Any, Any, None]:
        """CPU work: on the node's own cores (a real cluster), or queued for the emulation
        host's few cores, which every emulated node shares."""
        if self.host is None:
            yield self.env.timeout(seconds)
            return
        with self.host.request() as r:
            yield r
            yield self.env.timeout(seconds)

    # -- moving bytes ----------------------------------------------------------------------

    def transfer(self, a: int, b: int, nbytes: int) -> Generator[Any, Any, None]:
        """``nbytes`` from node a to node b, in packets of ``chunk_bytes``: each packet
        holds a's out-link and b's in-link for its time on the wire, so transfers that
        share a link interleave (as TCP flows through tbf do) instead of one waiting for
        another to end."""
        p = self.p
        left = nbytes
        while left > 0:
            k = min(left, p.chunk_bytes)
            with self.out[a].request() as o:
                yield o
                with self.inl[b].request() as i:
                    yield i
                    yield self.env.timeout(k / p.link_Bps)
            left -= k
        yield self.env.timeout(p.latency_s)

    def from_origin(self, nbytes: int) -> Generator[Any, Any, None]:
        p = self.p
        with self.pfs.request() as r:
            yield r
            yield self.env.timeout(p.pfs_open_s + nbytes * p.pfs_streams / p.pfs_Bps)

    # -- staging ---------------------------------------------------------------------------

    def stage(self) -> Generator[Any, Any, None]:
        have = [self.env.event() for _ in range(self.nshards)]
        holders = self.placement.holders

        def primary(node: int) -> Generator[Any, Any, None]:
            for s in range(self.nshards):
                if holders[s][0] == node:
                    yield from self.from_origin(self.p.shard_bytes)
                    self.res.staging_origin_bytes += self.p.shard_bytes
                    have[s].succeed()

        def replica(node: int) -> Generator[Any, Any, None]:
            for s in range(self.nshards):
                if node in holders[s][1:]:
                    yield have[s]
                    src = holders[s][0]
                    with self.loop[src].request() as r:
                        yield r
                        yield self.env.timeout(self.p.req_s + self.p.shard_bytes *
                                               self.p.byte_s)
                    yield from self.transfer(src, node, self.p.shard_bytes)

        procs = [self.env.process(primary(k)) for k in range(self.n)]
        procs += [self.env.process(replica(k)) for k in range(self.n)]
        yield simpy.AllOf(self.env, procs)

    # -- reading ---------------------------------------------------------------------------

    def holder_for(self, node: int, shard: int, avoid: int = -2) -> int | None:
        """The node to ask for ``shard`` (None: this node holds it): the less busy of two
        of its holders not known dead (and not ``avoid``), by requests in flight."""
        known = self.env.now >= self.dead_at + self.p.hedge_s  # a reader's requests to it
        hs = [h for h in self.placement.holders[shard]
              if h != avoid and not (known and h == self.dead)]
        if node in hs:
            return None
        if not hs:
            return -1  # no live copy: the origin
        if len(hs) == 1:
            return hs[0]
        a, b = self.rng.sample(hs, 2)
        return a if self.inflight[a] <= self.inflight[b] else b

    def part(self, node: int, peer: int, k: int) -> Generator[Any, Any, None]:
        p = self.p
        nbytes = k * p.sample_bytes
        if peer == -1:
            yield from self.from_origin(nbytes)
            self.res.origin_fallback_bytes += nbytes
            return
        self.inflight[peer] += 1
        try:
            yield self.env.timeout(p.latency_s)  # the request
            if self.env.now >= self.dead_at and peer == self.dead:
                yield self.env.timeout(p.hedge_s)  # no answer: to the next holder
                self.hedged_parts += 1
                return
            with self.loop[peer].request() as r:
                yield r
                yield from self.cpu(p.req_s + nbytes * p.byte_s)
            yield from self.transfer(peer, node, nbytes)
        finally:
            self.inflight[peer] -= 1

    def fetch(self, node: int, batch: list[int]) -> Generator[Any, Any, None]:
        p = self.p
        yield from self.cpu(p.reader_batch_s)
        groups: dict[int, list[int]] = {}
        local = 0
        for sample in batch:
            h = self.holder_for(node, sample // self.per_shard)
            if h is None:
                local += 1
            else:
                groups.setdefault(h, []).append(sample)
        if local:
            yield from self.cpu(local * p.local_s)
        while groups:
            relay = node != self.dead
            if relay:
                with self.loop[node].request() as r:
                    yield r
                    yield from self.cpu(p.relay_s)
            t0 = self.env.now
            yield simpy.AllOf(self.env, [self.env.process(self.part(node, h, len(s)))
                                         for h, s in groups.items()])
            retry: dict[int, list[int]] = {}
            for h, samples in groups.items():
                if h == self.dead and t0 + p.latency_s >= self.dead_at:
                    for sample in samples:  # hedged away from the dead node
                        h2 = self.holder_for(node, sample // self.per_shard, avoid=h)
                        if h2 is not None:
                            retry.setdefault(h2, []).append(sample)
            groups = retry

    def reader(self, node: int, epoch: int) -> Generator[Any, Any, None]:
        p = self.p
        order = list(range(self.n * p.samples_per_node))
        random.Random(p.seed + epoch).shuffle(order)
        mine = order[node :: self.n]
        batches = [mine[i : i + p.batch] for i in range(0, len(mine), p.batch)]
        fetches = [self.env.process(self.fetch(node, b)) for b in batches[: p.prefetch]]
        for i in range(len(batches)):
            yield fetches[i]
            if i + p.prefetch < len(batches):
                fetches.append(self.env.process(self.fetch(node, batches[i + p.prefetch])))
            yield self.env.timeout(p.compute_s)

    def rereplicate(self, victim: int) -> Generator[Any, Any, None]:
        """Each shard the dead node held, copied to the next node of its ranking from a
        surviving holder (the rereplicator's rule, with the survivors' links)."""
        jobs = []
        for hs in self.placement.holders:
            if victim in hs:
                live = [h for h in hs if h != victim]
                if not live:
                    continue
                taker = next(k for k in self.rng.sample(range(self.n), self.n)
                             if k != victim and k not in hs)
                jobs.append(self.env.process(self.transfer(live[0], taker, self.p.shard_bytes)))
                self.res.rereplicated_bytes += self.p.shard_bytes
        yield simpy.AllOf(self.env, jobs)

    def run(self) -> Outcome:
        p = self.p
        self.env.process(self.stage())
        self.env.run()
        self.res.staging_s = self.env.now
        for e in range(p.epochs):
            start = self.env.now
            if p.kill_at is not None and e == p.epochs - 1 and self.n > 1:
                victim = self.n - 1
                est = self.res.epochs_s[-1] if self.res.epochs_s else (
                    p.samples_per_node / p.batch * p.compute_s)

                def kill(at: float = start + p.kill_at * est,
                         victim: int = victim) -> Generator[Any, Any, None]:
                    yield self.env.timeout(at - self.env.now)
                    self.dead, self.dead_at = victim, self.env.now
                    yield from self.rereplicate(victim)

                self.env.process(kill())
            procs = [self.env.process(self.reader(k, e)) for k in range(self.n)]
            self.env.run(simpy.AllOf(self.env, procs))
            self.res.epochs_s.append(self.env.now - start)
        return self.res


def simulate(n: int, p: Params) -> Outcome:
    return Sim(n, p).run()


def load_calibration(path: str) -> tuple[Params, dict[str, Any]]:
    with open(path) as f:
        doc = json.load(f)
    s, cal = doc["settings"], doc.get("calibration", {})
    p = Params(samples_per_node=s["samples_per_node"], sample_bytes=s["sample_kib"] * 1024,
               batch=s["batch"], compute_s=s["compute_ms"] / 1000, prefetch=s["prefetch"],
               epochs=s["epochs"], replicas=s["replicas"], link_Bps=s["rate_mbit"] * 1e6 / 8,
               seed=s["seed"])
    known = {f for f in Params.__dataclass_fields__} - {"local_s"}  # see Params.local_s
    return replace(p, **{k: v for k, v in cal.items() if k in known}), doc


def fit(p: Params, n: int, measured_s: float) -> Params:
    """Calibrate the one constant not measured directly: the reader's CPU per batch (its
    Python, its wake-ups on a busy host), so that the model gives the epoch time measured at
    ``n`` nodes; the other sizes are then predictions."""
    lo, hi = 0.0, 0.05
    for _ in range(20):
        mid = (lo + hi) / 2
        if simulate(n, replace(p, reader_batch_s=mid)).epochs_s[-1] < measured_s:
            lo = mid
        else:
            hi = mid
    return replace(p, reader_batch_s=(lo + hi) / 2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibration", required=True,
                    help="emulated.json written by benchmarks/emucluster.py")
    ap.add_argument("--nodes", type=int, nargs="+", default=[32, 64, 512, 1024, 4096])
    ap.add_argument("--kill", action="store_true", help="also with a node lost mid-epoch")
    ap.add_argument("--out", default=None, help="write scale_sim.json here")
    ap.add_argument("--fit", type=int, default=None, metavar="N",
                    help="fit the reader's cost per batch to the emulated run at N nodes")
    ap.add_argument("--host-cores", type=int, default=None,
                    help="model the emulation: every node's CPU on this many cores")
    a = ap.parse_args(argv)
    p, doc = load_calibration(a.calibration)
    measured = {r["nodes"]: r for r in doc["runs"]}
    if a.host_cores:
        p = replace(p, host_cores=a.host_cores)
    if a.fit is not None:
        p = fit(p, a.fit, measured[a.fit]["epochs_s"][-1])
        print(f"fitted at N={a.fit}: reader cost per batch {p.reader_batch_s * 1000:.2f} ms")
    base = simulate(1, p)
    rows: list[dict[str, Any]] = []
    for n in a.nodes:
        for kill in ([False, True] if a.kill else [False]):
            q = replace(p, kill_at=0.5 if kill else None)
            o = simulate(n, q)
            eff = [b / t for b, t in zip(base.epochs_s, o.epochs_s, strict=True)]
            row = {"nodes": n, "killed": kill, **asdict(o), "efficiency": eff}
            m = measured.get(n)
            if m is not None and not kill:
                row["measured_epochs_s"] = m["epochs_s"]
                row["measured_staging_s"] = m["staging_s"]
                row["error_epoch"] = [o.epochs_s[i] / m["epochs_s"][i] - 1
                                      for i in range(len(o.epochs_s))]
                row["error_staging"] = o.staging_s / m["staging_s"] - 1
            rows.append(row)
            err = (f"  (measured epoch {m['epochs_s'][-1]:.2f} s: "
                   f"{row['error_epoch'][-1]:+.1%}; staging {m['staging_s']:.1f} s: "
                   f"{row['error_staging']:+.1%})" if m is not None and not kill else "")
            print(f"N={n}{' node lost' if kill else ''}: staging {o.staging_s:.1f} s, "
                  f"epochs {[round(x, 2) for x in o.epochs_s]} s, efficiency "
                  f"{statistics.fmean(eff):.3f} (last {eff[-1]:.3f}){err}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"params": asdict(p), "fit": a.fit, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
