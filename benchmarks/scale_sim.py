"""A discrete-event model of a stagefs job at scale (SimPy): staging, then epochs, with and
without a node lost mid-epoch. It replaces the old analytic scale model, which modelled I/O
only, ignored prefetch depth and, re-run, said 100% at any size (it modelled nothing that
limits).

What is modelled (each a SimPy resource or process):
- **Links.** Every node has an outgoing and an incoming link of ``link_Bps``, shared
  fairly by the transfers (flows) on it, as TCP flows through tc's tbf share it: a flow's
  rate is the smaller of its two links' shares (``link_Bps`` / flows on the link),
  recomputed on the links a flow starts or ends on (``Links``), and a message adds the
  one-way latency. The cost of the model is one event per flow and per change of its rate,
  not per packet: 4,096 nodes run in minutes.
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
  computes for ``compute_s``. The next epoch's first batches are asked for before it
  starts (``epoch_ahead``, as emu_reader.py does). Nodes start each epoch together (the
  all-reduce holds them): the job's epoch time is its slowest node's.
- **The emulation host** (``host_cores``): every node's CPU work (requests served and
  relayed, the readers' ``reader_batch_s`` per batch, the daemons' background
  ``daemon_bg_s`` a second, the lost node's reader's ``connect_s`` per connection) queues
  for these cores; without it each node has its own (a real cluster).
- **A lost node.** At ``kill_at`` of an epoch the node's daemon stops answering: requests
  sent to it wait ``hedge_s`` (a node down; a round trip when its kernel refuses them,
  ``lost_refuses``: a daemon killed, as the emulation does) and go to the next holder
  (another replica, or the origin if none), and a reader stops asking it once one of its
  requests to it failed. ``dead_after_s`` later (the daemons'
  ``--dead-after``) the survivors re-replicate its shards by the daemons' own rule
  (rereplicate.plan: the next live node of each shard's ranking copies it from a surviving
  holder, or from the origin if none survives), over the links, competing with reads;
  readers ask a taker once it has the copy. Its reader goes on (its tier files are still
  there), reading remote samples straight from the holders.

Calibration: every constant comes from measurements on the emulated cluster
(benchmarks/emucluster.py writes them: CPU costs at the smallest N > 1 of its run,
``connect_s`` where a node was lost), none fitted to an epoch time; validation: the model
predicts the emulated runs at 32 and 64 nodes and with a node lost, side by side with what
was measured (docs/scale.md).

    python benchmarks/scale_sim.py --calibration benchmarks/results/emulated.json \\
        benchmarks/results/emulated-kill.json --nodes 32 64 512 1024 4096 --kill
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Generator
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any

import simpy

from stagefs.cluster.placement import place  # the placement the daemons use
from stagefs.cluster.rereplicate import plan  # and their re-replication rule


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
    reader_batch_s: float = 0.0003  # the reader's own CPU per batch (its Python, client)
    daemon_bg_s: float = 0.0  # a daemon's background CPU a second (probes, housekeeping)
    host_cores: int | None = None  # the emulation: every node's CPU work on these cores
    epoch_ahead: bool = True  # readers ask for the next epoch's first batches before it
    pfs_Bps: float = 100e6
    pfs_streams: int = 8
    pfs_open_s: float = 0.002
    hedge_s: float = 0.5
    # how a node is lost: silent (a node down: requests to it wait ``hedge_s``), or its
    # kernel refusing (a daemon killed on a node that is up, as emucluster.py --kill does:
    # its connections reset, requests fail after a round trip)
    lost_refuses: bool = False
    # a reader whose node's daemon is lost reads from the holders itself: each peer's first
    # request opens a connection (two round trips: connect, token) and costs this CPU
    connect_s: float = 0.0
    dead_after_s: float = 30.0  # the daemons' --dead-after: then they re-replicate
    # a lost node
    kill_at: float | None = None  # fraction of the last epoch
    seed: int = 0

    def lost_wait(self) -> float:
        """How long a request to the lost node waits before it goes to the next holder."""
        return 2 * self.latency_s if self.lost_refuses else self.hedge_s

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
    rereplicated_bytes: int = 0  # a dead node's shards copied from surviving replicas
    rereplicated_origin_bytes: int = 0  # and those with no surviving replica, from the origin
    hedged_parts: int = 0  # requests sent to the dead node, gone to the next holder


class _Flow:
    """One transfer on the links: ``left`` bytes at ``rate`` since time ``t``."""

    __slots__ = ("done", "dst", "left", "rate", "src", "t", "version")

    def __init__(self, src: int, dst: int, nbytes: float, t: float, done: simpy.Event) -> None:
        self.src, self.dst, self.left, self.t, self.done = src, dst, nbytes, t, done
        self.rate = 0.0
        self.version = 0


class Links:
    """Every node's outgoing and incoming link, each of ``Bps``, shared fairly by the flows
    on it (TCP flows through tbf share so): a flow's rate is the smaller of its two links'
    fair shares, ``Bps / flows on that link``, recomputed for the flows of both links when
    a flow starts or ends on either. One event per flow and per change of its rate, however
    many bytes it moves. Not max-min fair: a flow held back by one of its links does not
    hand its unused share of the other to the rest (a little pessimistic)."""

    def __init__(self, env: simpy.Environment, nodes: int, Bps: float) -> None:
        self.env, self.Bps = env, Bps
        # dicts, not sets: flows in the order they started, so a run is repeatable
        self.out: list[dict[_Flow, None]] = [{} for _ in range(nodes)]
        self.inl: list[dict[_Flow, None]] = [{} for _ in range(nodes)]

    def rate(self, src: int, dst: int) -> float:
        """What a flow from ``src`` to ``dst`` gets now (it counted on both links)."""
        return self.Bps / max(len(self.out[src]), len(self.inl[dst]), 1)

    def send(self, src: int, dst: int, nbytes: float) -> simpy.Event:
        """Start a flow of ``nbytes``; the event fires when its last byte has arrived."""
        f = _Flow(src, dst, float(nbytes), self.env.now, self.env.event())
        self.out[src][f] = None
        self.inl[dst][f] = None
        self._reshare(src, dst)
        return f.done

    def _reshare(self, src: int, dst: int) -> None:
        for g in {**self.out[src], **self.inl[dst]}:
            r = self.rate(g.src, g.dst)
            if r == g.rate:
                continue
            now = self.env.now
            g.left = max(0.0, g.left - g.rate * (now - g.t))
            g.t, g.rate = now, r
            g.version += 1
            self.env.timeout(g.left / r).callbacks.append(partial(self._end, g, g.version))

    def _end(self, g: _Flow, version: int, _event: simpy.Event | None = None) -> None:
        if version != g.version:  # its rate changed since: a later timeout ends it
            return
        del self.out[g.src][g], self.inl[g.dst][g]
        g.done.succeed()
        self._reshare(g.src, g.dst)


class Sim:
    def __init__(self, n: int, p: Params) -> None:
        self.n, self.p = n, p
        self.env = simpy.Environment()
        self.links = Links(self.env, n, p.link_Bps)
        self.loop = [simpy.Resource(self.env, 1) for _ in range(n)]
        self.pfs = simpy.Resource(self.env, p.pfs_streams)
        self.host = simpy.Resource(self.env, p.host_cores) if p.host_cores else None
        self.rng = random.Random(p.seed)
        self.nshards = p.shards(n)
        self.placement = place(self.nshards, n, p.replicas, seed=p.seed)
        # who holds each shard now: the placement, then the takers of a dead node's shards
        # once they have copied them
        self.holders = [list(h) for h in self.placement.holders]
        self.inflight = [0] * n
        self.hedged_parts = 0
        self.dead: int | None = None
        self.dead_at = float("inf")
        self.res = Outcome(n)
        self.per_shard = max(1, p.shard_bytes // p.sample_bytes)
        self._orders: dict[int, list[int]] = {}
        self.ahead: dict[int, list[simpy.Process]] = {}  # a node's next-epoch fetches
        self.direct: set[int] = set()  # peers the lost node's reader has connected to
        self.knows: set[int] = set()  # nodes whose requests found the lost node dead

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
        """``nbytes`` from node a to node b: one flow on a's out-link and b's in-link, then
        the one-way latency."""
        yield self.links.send(a, b, nbytes)
        yield self.env.timeout(self.p.latency_s)

    def from_origin(self, nbytes: int) -> Generator[Any, Any, None]:
        p = self.p
        with self.pfs.request() as r:
            yield r
            yield self.env.timeout(p.pfs_open_s + nbytes * p.pfs_streams / p.pfs_Bps)

    # -- staging ---------------------------------------------------------------------------

    def stage(self) -> Generator[Any, Any, None]:
        have = [self.env.event() for _ in range(self.nshards)]
        holders = self.placement.holders
        primaries: list[list[int]] = [[] for _ in range(self.n)]
        copies: list[list[int]] = [[] for _ in range(self.n)]
        for s, h in enumerate(holders):
            primaries[h[0]].append(s)
            for k in h[1:]:
                copies[k].append(s)

        def primary(node: int) -> Generator[Any, Any, None]:
            for s in primaries[node]:
                yield from self.from_origin(self.p.shard_bytes)
                self.res.staging_origin_bytes += self.p.shard_bytes
                have[s].succeed()

        def replica(node: int) -> Generator[Any, Any, None]:
            for s in copies[node]:
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

    def gone(self, node: int) -> bool:
        return node == self.dead and self.env.now >= self.dead_at

    def holder_for(self, node: int, shard: int, avoid: int = -2) -> int | None:
        """The node to ask for ``shard`` (None: this node holds it): the less busy of two
        of its holders not known dead (and not ``avoid``), by requests in flight."""
        hs = [h for h in self.holders[shard]  # not one a request of this node found dead
              if h != avoid and not (h == self.dead and node in self.knows)]
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
            if self.gone(node) and peer not in self.direct:  # the lost node's reader
                self.direct.add(peer)
                yield from self.cpu(p.connect_s)
                yield self.env.timeout(4 * p.latency_s)
            yield self.env.timeout(p.latency_s)  # the request
            if self.gone(peer):
                yield self.env.timeout(p.lost_wait() - p.latency_s)  # to the next holder
                self.hedged_parts += 1
                self.knows.add(node)  # this node asks it no more
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
            if not self.gone(node):  # relayed through the node's daemon, while it lives
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

    def order(self, epoch: int) -> list[int]:
        """The epoch's global shuffle (seed + epoch), computed once for every node."""
        if epoch not in self._orders:  # this epoch's and the next (read ahead) are kept
            order = list(range(self.n * self.p.samples_per_node))
            random.Random(self.p.seed + epoch).shuffle(order)
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = order
        return self._orders[epoch]

    def batches(self, node: int, epoch: int) -> list[list[int]]:
        mine = self.order(epoch)[node :: self.n]
        return [mine[i : i + self.p.batch] for i in range(0, len(mine), self.p.batch)]

    def reader(self, node: int, epoch: int) -> Generator[Any, Any, None]:
        """One node's epoch, as emu_reader.py runs it: at each step, ``prefetch`` batches
        in flight (this one included), then compute. With the epoch ahead, the batches
        after this epoch's last are the next epoch's first (its order is known), started
        here and waited for by the next epoch's reader."""
        p = self.p
        batches = self.batches(node, epoch)
        fetches = self.ahead.pop(node, [])
        nxt: list[list[int]] = []
        if p.epoch_ahead and epoch + 1 < p.epochs:
            nxt = self.batches(node, epoch + 1)
        ahead: list[simpy.Process] = []
        for i in range(len(batches)):
            while (j := len(fetches) + len(ahead)) < min(i + p.prefetch,
                                                         len(batches) + len(nxt)):
                if j < len(batches):
                    fetches.append(self.env.process(self.fetch(node, batches[j])))
                else:
                    ahead.append(self.env.process(self.fetch(node, nxt[len(ahead)])))
            yield fetches[i]
            yield self.env.timeout(p.compute_s)
        if ahead:
            self.ahead[node] = ahead

    def background(self, node: int) -> Generator[Any, Any, None]:
        """A daemon's background work (health probes, housekeeping): ``daemon_bg_s`` of
        CPU a second, on the host's cores, while it lives."""
        while not self.gone(node):
            yield from self.cpu(self.p.daemon_bg_s)
            yield self.env.timeout(1.0)

    def rereplicate(self, victim: int) -> Generator[Any, Any, None]:
        """The dead node's shards copied again, by the daemons' rule (rereplicate.plan):
        each goes to the next live node of its ranking, from a surviving holder, or from
        the origin when none survives. Readers ask the taker once it has the shard."""
        jobs = []
        takers = {n for s, h in enumerate(self.placement.holders) if victim in h
                  for n in self.placement.live(s, {victim}) if n not in h}
        for taker in sorted(takers):
            for shard, sources in plan(self.placement, taker, {victim}).items():
                jobs.append(self.env.process(self.copy(shard, taker, sources)))
        yield simpy.AllOf(self.env, jobs)

    def copy(self, shard: int, taker: int, sources: list[int]) -> Generator[Any, Any, None]:
        nbytes = self.p.shard_bytes
        if sources:
            yield from self.transfer(sources[0], taker, nbytes)
            self.res.rereplicated_bytes += nbytes
        else:
            yield from self.from_origin(nbytes)
            self.res.rereplicated_origin_bytes += nbytes
        self.holders[shard].append(taker)

    def run(self) -> Outcome:
        p = self.p
        self.env.process(self.stage())
        self.env.run()
        self.res.staging_s = self.env.now
        if self.host is not None and p.daemon_bg_s:
            for k in range(self.n):
                self.env.process(self.background(k))
        for e in range(p.epochs):
            start = self.env.now
            if p.kill_at is not None and e == p.epochs - 1 and self.n > 1:
                # the last node, as emucluster.py --kill, or the last one that holds a
                # shard (rendezvous placement leaves a few nodes none: losing one costs
                # its reader's daemon only)
                victim = max(k for h in self.placement.holders for k in h)
                est = self.res.epochs_s[-1] if self.res.epochs_s else (
                    p.samples_per_node / p.batch * p.compute_s)

                def kill(at: float = start + p.kill_at * est,
                         victim: int = victim) -> Generator[Any, Any, None]:
                    yield self.env.timeout(at - self.env.now)
                    self.dead, self.dead_at = victim, self.env.now
                    yield self.env.timeout(p.dead_after_s)  # the daemons' --dead-after
                    yield from self.rereplicate(victim)

                self.env.process(kill())
            procs = [self.env.process(self.reader(k, e)) for k in range(self.n)]
            self.env.run(simpy.AllOf(self.env, procs))
            self.res.epochs_s.append(self.env.now - start)
        self.res.hedged_parts = self.hedged_parts
        return self.res


def simulate(n: int, p: Params) -> Outcome:
    return Sim(n, p).run()


KILL_CONSTANTS = {"connect_s"}  # measured only where a node was lost (emulated-kill.json)


def emulated(flag: str, path: str) -> dict[str, Any]:
    """An emulated.json of benchmarks/emucluster.py, or a SystemExit naming the flag and the
    file (a missing or foreign file was a traceback from open, json or a KeyError)."""
    why = "no 'settings' and 'runs' in it"
    try:
        with open(path) as f:
            doc = json.load(f)
        if isinstance(doc, dict) and isinstance(doc.get("settings"), dict) and isinstance(
                doc.get("runs"), list):
            return doc
    except OSError as exc:
        why = exc.strerror or str(exc)
    except ValueError:
        why = "not JSON"
    raise SystemExit(f"scale_sim: {flag} {path}: {why}: give an emulated.json that "
                     "benchmarks/emucluster.py --out DIR wrote")


def load_calibration(path: str) -> tuple[Params, dict[str, Any]]:
    doc = emulated("--calibration", path)
    s, cal = doc["settings"], doc.get("calibration", {})
    try:
        p = Params(samples_per_node=s["samples_per_node"], sample_bytes=s["sample_kib"] * 1024,
                   batch=s["batch"], compute_s=s["compute_ms"] / 1000, prefetch=s["prefetch"],
                   epochs=s["epochs"], replicas=s["replicas"],
                   link_Bps=s["rate_mbit"] * 1e6 / 8, seed=s["seed"],
                   dead_after_s=s.get("dead_after", Params.dead_after_s),
                   epoch_ahead=s.get("epoch_ahead", False),
                   lost_refuses=bool(s.get("kill")))  # --kill: a daemon SIGKILLed, its node up
    except KeyError as exc:
        raise SystemExit(f"scale_sim: --calibration {path}: its settings lack {exc}: give an "
                         "emulated.json that benchmarks/emucluster.py --out DIR wrote") from None
    known = {f for f in Params.__dataclass_fields__} - {"local_s"}  # see Params.local_s
    return replace(p, **{k: v for k, v in cal.items() if k in known}), doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibration", required=True, nargs="+",
                    help="emulated.json written by benchmarks/emucluster.py: the first gives "
                         "the workload and the constants, the others the constants it lacks "
                         "(emulated-kill.json: connect_s, measured where a node was lost)")
    ap.add_argument("--measured", default=None,
                    help="the emulated runs to compare with (default: the calibration's); "
                         "a --kill run's settings say how the node was lost")
    ap.add_argument("--nodes", type=int, nargs="+", default=[32, 64, 512, 1024, 4096])
    ap.add_argument("--kill", action="store_true", help="also with a node lost mid-epoch")
    ap.add_argument("--out", default=None, help="write scale_sim.json here")
    ap.add_argument("--host-cores", type=int, default=None,
                    help="model the emulation: every node's CPU on this many cores")
    a = ap.parse_args(argv)
    p, doc = load_calibration(a.calibration[0])
    for path in a.calibration[1:]:
        more = emulated("--calibration", path).get("calibration", {})
        p = replace(p, **{k: v for k, v in more.items() if k in KILL_CONSTANTS})
    if a.measured:
        doc = emulated("--measured", a.measured)
        # how the emulation lost its node: a daemon SIGKILLed, its kernel refusing
        p = replace(p, lost_refuses=bool(doc["settings"].get("kill")))
    measured = {r["nodes"]: r for r in doc["runs"]}
    if a.host_cores:
        p = replace(p, host_cores=a.host_cores)
    base = simulate(1, p)
    measured_kill = bool(doc["settings"].get("kill"))  # the emulated runs lost a node
    rows: list[dict[str, Any]] = []
    for n in a.nodes:
        for kill in ([False, True] if a.kill else [False]):
            t0 = time.perf_counter()
            o = simulate(n, replace(p, kill_at=0.5 if kill else None))
            eff = [b / t for b, t in zip(base.epochs_s, o.epochs_s, strict=True)]
            row = {"nodes": n, "killed": kill, **asdict(o), "efficiency": eff,
                   "model_wall_s": time.perf_counter() - t0}
            m = measured.get(n) if kill == measured_kill else None
            err = ""
            if m is not None:
                row["measured_epochs_s"] = m["epochs_s"]
                row["measured_staging_s"] = m["staging_s"]
                row["error_epoch"] = [o.epochs_s[i] / m["epochs_s"][i] - 1
                                      for i in range(len(o.epochs_s))]
                row["error_staging"] = o.staging_s / m["staging_s"] - 1
                err = (f"  (measured epoch {m['epochs_s'][-1]:.2f} s: "
                       f"{row['error_epoch'][-1]:+.1%}; staging {m['staging_s']:.1f} s: "
                       f"{row['error_staging']:+.1%})")
            rows.append(row)
            print(f"N={n}{' node lost' if kill else ''}: staging {o.staging_s:.1f} s, "
                  f"epochs {[round(x, 2) for x in o.epochs_s]} s, efficiency "
                  f"{statistics.fmean(eff):.3f} (last {eff[-1]:.3f}){err} "
                  f"[{row['model_wall_s']:.0f} s to run]", flush=True)
            if a.out:  # after each row: a long run cut short keeps what it computed
                with open(a.out, "w") as f:
                    json.dump({"params": asdict(p), "rows": rows}, f, indent=1)
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
