"""An emulated cluster: N stagefs daemons, each a node of its own behind a shaped link.

Each node is a network namespace (its own address on a bridge) whose veth is shaped with tc
(tbf) in both directions to ``--rate-mbit``: what one node's network gives it. The origin is
the test PFS (/tmp/pfs, ../shared/testbed/pfs.sh) when it is mounted, else a local directory
(a file system with no metadata server: say so in the results). Every node runs a daemon
(``stagefs serve``, static bootstrap, its own tier in /dev/shm and runtime directory) and one
training process (emu_reader.py: epochs of its slice of the global shuffle, batches read
with prefetch, a simulated compute time per batch).

Weak scaling: every node has the same work (``--samples-per-node``), so the dataset grows
with N; the efficiency of an epoch is T(1) / T(N), the job's epoch time (its slowest node)
at one node over at N. Also measured per N: staging time, origin bytes during staging
against the dataset, origin bytes the readers fell back on, connections per daemon (TCP,
counted with ss in each node), CPU seconds per daemon and per reader. ``--kill`` kills one
daemon halfway through the last epoch (SIGKILL) and reports that epoch. ``--partition S``
cuts the last nodes (``--partition-nodes``, default N/4) off from every other node halfway
through the first epoch for S seconds, connects them again, and reports what each side did
(origin fallbacks, deaths seen, re-replication) and how long the rejoin took. Every sample
a reader reads is checked against the digest of its source file.

Scale on one machine: 2 cores cannot do the work of 64 real nodes, so the rates are scaled
down by one ratio at every N: each link gives 20 Mbit/s, a real node's 100 Gbit/s scaled by
1/5000, and each node reads 5 samples of 64 KiB a second (batches of 4, 800 ms of compute a
batch: 2.6 Mbit/s, 13% of its link; a real node's 13 Gbit/s at that ratio). Samples take as
long on a link as they would at full scale, so the daemons' delays (hedging, deadlines, in
seconds) mean what they mean on a real cluster; the samples a second per node are what is
scaled down, so that the sum of 64 nodes' work (their daemons' and readers' CPU) stays near
half of this machine's 2 cores. The harness measures it: the host's busy cores (every
process, /proc/stat) and our daemons' and readers' during each epoch, and the load average
before and after each N.

    python benchmarks/emucluster.py --nodes 1 8 16 32 64 --out benchmarks/results

Needs root (namespaces, tc). Prints a table, writes emulated.json (and emulated.png with
matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from xxhash import xxh3_64_hexdigest

import stagefs
from stagefs._table import table
from stagefs.format import MANIFEST_NAME, Manifest

HERE = Path(__file__).resolve().parent
READER = str(HERE / "emu_reader.py")
BRIDGE, NET = "sfsemu0", "10.79"  # nodes 10.79.<k // 200>.<10 + k % 200>
PORT = 7070


@dataclass
class Settings:
    samples_per_node: int = 128
    sample_kib: int = 64
    batch: int = 4
    compute_ms: float = 800.0  # 5 samples/s a node: 64 nodes' work fits 2 cores (scale.md)
    prefetch: int = 4
    epochs: int = 2
    rate_mbit: float = 20.0
    replicas: int = 2
    kill: bool = False
    partition: float = 0.0  # seconds some nodes are cut off, from the middle of epoch 1
    partition_nodes: int = 0  # how many (the last ones); 0: a quarter of N, at least one
    dead_after: float = 30.0  # the daemons' --dead-after
    seed: int = 0
    real_link_gbit: float = 100.0  # what one emulated link stands for
    epoch_ahead: bool = True  # readers ask for the next epoch's first batches before it
    idle_s: float = 4.0  # after staging: the daemons' background CPU measured this long

    def cut_off(self, n: int) -> list[int]:
        """The nodes the partition cuts off at N nodes: the last ones."""
        if not self.partition or n < 2:
            return []
        k = self.partition_nodes or max(1, n // 4)
        return list(range(n - min(k, n - 1), n))

    def demand_mbit(self) -> float:
        """The link rate one node's reader needs to keep up: batch bytes per compute."""
        return self.batch * self.sample_kib * 1024 * 8 / (self.compute_ms / 1000) / 1e6


@dataclass
class RunResult:
    nodes: int
    staging_s: float = 0.0
    dataset_bytes: int = 0
    staging_origin_bytes: int = 0
    staging_origin_meta: int = 0  # opens + stats of shard files on the origin, all daemons
    epochs_s: list[float] = field(default_factory=list)  # the job's: its slowest node's
    stall_s: list[float] = field(default_factory=list)  # mean over nodes
    reader_origin_bytes: int = 0  # readers' fallbacks to the origin
    reader_errors: int = 0
    wrong_samples: int = 0  # samples whose bytes differ from the source file's
    checksum_failures: int = 0
    connections_max: int = 0  # established TCP connections of one node, the most
    connections_mean: float = 0.0
    daemon_cpu_s: float = 0.0  # mean per daemon, whole run
    reader_cpu_s: float = 0.0  # mean per reader
    killed: int | None = None
    partition: dict[str, Any] = field(default_factory=dict)  # what the cut-off nodes did
    origin: str = ""
    tcp_peak_per_peer: float = 0.0  # the daemons' own count: most TCP peers at once / peer
    epoch_daemon_cpu_s: float = 0.0  # mean per daemon, during the epochs
    requests: int = 0  # served by all daemons during the epochs (peer requests + relays)
    calibration: dict[str, float] = field(default_factory=dict)
    # what the run cost the emulation host, per epoch (from the first node's start to the
    # last node's end): its busy cores (/proc/stat, every process), the cores our daemons
    # and readers used, CPU per daemon and per reader; the load average before and after
    host_busy_cores: list[float] = field(default_factory=list)
    ours_cores: list[float] = field(default_factory=list)
    others_cores: list[float] = field(default_factory=list)  # busy - ours: the harness, others
    epoch_daemon_cpu: list[float] = field(default_factory=list)  # mean per live daemon
    epoch_reader_cpu: list[float] = field(default_factory=list)  # mean per reader
    daemon_idle_cpu_per_s: float = 0.0  # background, staged and no reader yet
    load_before: list[float] = field(default_factory=list)
    load_after: list[float] = field(default_factory=list)
    batches: int = 0  # per node and epoch (steps per epoch)
    node_epochs_s: list[list[float]] = field(default_factory=list)  # [epoch][node]
    node_stall_s: list[list[float]] = field(default_factory=list)
    node_reader_cpu: list[list[float]] = field(default_factory=list)
    node_peer_connects: list[int] = field(default_factory=list)  # readers' own, to peers


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True, timeout=120)


def node_ip(k: int) -> str:
    return f"{NET}.{k // 200}.{10 + k % 200}"


class Net:
    """The bridge and one namespace per node, links shaped both ways."""

    def __init__(self, n: int, rate_mbit: float) -> None:
        self.n, self.rate = n, rate_mbit
        self.ns = [f"sfsemu{k}" for k in range(n)]
        self._neigh: dict[str, str] = {}

    # The kernel's neighbour (ARP) table limits count the entries of every namespace
    # together: 64 nodes that each talk to 63 others overflow the default 1,024 ("neighbor
    # table overflow!"), connects time out at random, and daemons take live peers for dead.
    NEIGH: ClassVar[dict[str, str]] = {"gc_thresh1": "8192", "gc_thresh2": "16384",
                                       "gc_thresh3": "32768"}

    LOCK = "/tmp/stagefs-emucluster.lock"

    def __enter__(self) -> Net:
        # one emulated cluster at a time on a host: the namespaces, the bridge and its
        # subnet are the host's, and a harness starting cleans up what it finds of them
        self._lock = open(self.LOCK, "w")  # held until __exit__
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        self.close()
        for key, value in self.NEIGH.items():
            path = f"/proc/sys/net/ipv4/neigh/default/{key}"
            with open(path) as f:
                self._neigh[key] = f.read().strip()
            if int(self._neigh[key]) < int(value):
                with open(path, "w") as f:
                    f.write(value)
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "addr", "add", f"{NET}.255.1/16", "dev", BRIDGE)
        sh("ip", "link", "set", BRIDGE, "up")
        rate = f"{self.rate}mbit"
        for k, ns in enumerate(self.ns):
            h, p = f"se{k}h", f"se{k}p"
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", h, "type", "veth", "peer", "name", p)
            sh("ip", "link", "set", p, "netns", ns)
            sh("ip", "link", "set", h, "master", BRIDGE)
            sh("ip", "link", "set", h, "up")
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{node_ip(k)}/16", "dev", p)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", p, "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            for dev, where in ((h, []), (p, ["ip", "netns", "exec", ns])):
                sh(*where, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                   "burst", "64kb", "latency", "50ms")
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.close()
            for key, value in self._neigh.items():
                with open(f"/proc/sys/net/ipv4/neigh/default/{key}", "w") as f:
                    f.write(value)
        finally:
            self._lock.close()  # and the lock with it

    def close(self) -> None:
        for ns in sorted(set(sh("ip", "netns", "list", check=False).stdout.split())):
            if ns.startswith("sfsemu"):
                for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
                sh("ip", "netns", "del", ns, check=False)
        for line in sh("ip", "-o", "link", check=False).stdout.splitlines():
            name = line.split(":")[1].strip().split("@")[0] if line.count(":") > 1 else ""
            if name.startswith("se") and name.endswith("h") and name[2:-1].isdigit():
                sh("ip", "link", "del", name, check=False)  # left by a run that was killed
        sh("ip", "link", "del", BRIDGE, check=False)

    def cut(self, k: int, off: bool) -> None:
        """Cut node k off from every other node (its veth's bridge end down: no carrier,
        packets dropped, no reset sent), or connect it again. The origin, a file system of
        this host, stays reachable: a partition of the cluster network only."""
        sh("ip", "link", "set", f"se{k}h", "down" if off else "up")

    def run(self, k: int, cmd: list[str], log: str) -> subprocess.Popen[bytes]:
        out = open(log, "ab")  # noqa: SIM115 - the child's; closed when it ends
        try:
            return subprocess.Popen(["ip", "netns", "exec", self.ns[k], *cmd], stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            out.close()

    def connections(self, k: int) -> int:
        out = sh("ip", "netns", "exec", self.ns[k], "ss", "-Htn", "state", "established",
                 check=False).stdout
        return sum(1 for line in out.splitlines() if line.strip())


def make_dataset(origin: str, s: Settings, n: int) -> tuple[str, dict[str, str], int]:
    """N x samples_per_node incompressible samples, packed at ``origin``; the pack, every
    sample's path -> xxh3-64 of its bytes (the readers check what they read against it),
    and the dataset's bytes."""
    src = tempfile.mkdtemp(prefix="emu-src-", dir="/dev/shm")
    rnd = random.Random(s.seed)
    paths: dict[str, str] = {}
    try:
        for i in range(n * s.samples_per_node):
            rel = f"train/c{i % 16:02d}/s{i:06d}.bin"
            p = os.path.join(src, rel)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            data = rnd.randbytes(s.sample_kib * 1024)
            with open(p, "wb") as f:
                f.write(data)
            paths[rel] = xxh3_64_hexdigest(data)
        pack = os.path.join(origin, f"emu-{n}.pack")
        shutil.rmtree(pack, ignore_errors=True)
        stagefs.pack(src, pack, shard_size="4MiB", jobs=2, compress="none")
    finally:
        shutil.rmtree(src, ignore_errors=True)
    m = Manifest(os.path.join(pack, MANIFEST_NAME))
    size = sum(int(m.stored[e]) for e in m.files())
    m.close()
    return pack, paths, size


def loadavg() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def host_jiffies() -> tuple[int, int]:
    """All CPUs' busy and total time since boot (/proc/stat), in clock ticks."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    return sum(v) - idle, sum(v)


class Sampler:
    """Samples, every ``every`` seconds in a thread, the host's busy and total CPU time and
    the CPU seconds of our daemons and readers (each process's last value kept: a killed
    one counts what it used). ``window(t0, t1)`` gives what was used between two times."""

    def __init__(self, every: float = 0.5) -> None:
        self.every = every
        self.pids: dict[str, list[int]] = {"daemons": [], "readers": []}
        self.last: dict[int, float] = {}
        self.rows: list[tuple[float, int, int, float, float]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()

    def sample(self) -> None:
        busy, total = host_jiffies()
        sums = []
        for kind in ("daemons", "readers"):
            acc = 0.0
            for pid in self.pids[kind]:
                self.last[pid] = max(self.last.get(pid, 0.0), cpu_seconds(pid))
                acc += self.last[pid]
            sums.append(acc)
        self.rows.append((time.monotonic(), busy, total, sums[0], sums[1]))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every)

    def at(self, t: float) -> tuple[float, ...]:
        rows = self.rows
        for a, b in itertools.pairwise(rows):
            if a[0] <= t <= b[0]:
                w = (t - a[0]) / (b[0] - a[0]) if b[0] > a[0] else 0.0
                return tuple(x + w * (y - x) for x, y in zip(a, b, strict=True))
        return tuple(map(float, rows[0] if t < rows[0][0] else rows[-1]))

    def window(self, t0: float, t1: float) -> dict[str, float]:
        a, b = self.at(t0), self.at(t1)
        span = max(t1 - t0, 1e-9)
        ncpu = os.cpu_count() or 1
        return {"host_busy_cores": ncpu * (b[1] - a[1]) / max(b[2] - a[2], 1),
                "daemons_cpu": b[3] - a[3], "readers_cpu": b[4] - a[4],
                "ours_cores": (b[3] - a[3] + b[4] - a[4]) / span}


def cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


PINGPONG = r"""
import socket, sys, time
role, host = sys.argv[1], sys.argv[2]
if role == "server":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 7071)); s.listen(1); print("ready", flush=True)
    c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        m = c.recv(8)
        if not m: break
        n = int.from_bytes(m, "big")
        c.sendall(b"x" * n if n else b"y")
else:
    c = socket.create_connection((host, 7071)); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtt = []
    for _ in range(50):
        t = time.perf_counter(); c.sendall((0).to_bytes(8, "big")); c.recv(1); rtt.append(time.perf_counter() - t)
    rtt.sort()
    n = 4 << 20
    t = time.perf_counter(); c.sendall(n.to_bytes(8, "big")); got = 0
    while got < n: got += len(c.recv(1 << 20))
    bulk = time.perf_counter() - t
    print(rtt[len(rtt) // 2], n / bulk)
"""


def calibrate_net(net: Net, work: str) -> dict[str, float]:
    """One-way latency and the effective rate of one shaped link, node 1 -> node 0."""
    script = os.path.join(work, "pingpong.py")
    with open(script, "w") as f:
        f.write(PINGPONG)
    srv = subprocess.Popen(["ip", "netns", "exec", net.ns[1], sys.executable, script,
                            "server", node_ip(1)], stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout is not None and srv.stdout.readline().strip() == "ready"
        out = sh("ip", "netns", "exec", net.ns[0], sys.executable, script, "client",
                 node_ip(1)).stdout.split()
    finally:
        srv.kill()
        srv.wait()
        if srv.stdout is not None:
            srv.stdout.close()
    return {"latency_s": float(out[0]) / 2, "link_Bps": float(out[1])}


def calibrate_origin(pack: str) -> dict[str, float]:
    """The origin's rate with one stream and with eight, and the time of one open: read
    every shard (the page cache dropped first, when root)."""
    from concurrent.futures import ThreadPoolExecutor

    shards = sorted(os.path.join(pack, f) for f in os.listdir(pack) if f.endswith(".sfs"))

    def read(path: str) -> int:
        with open(path, "rb", buffering=0) as f:
            n = 0
            while chunk := f.read(1 << 20):
                n += len(chunk)
            return n

    def drop() -> None:
        with contextlib.suppress(OSError), open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")

    out: dict[str, float] = {}
    for streams in (1, 8):
        drop()
        t = time.perf_counter()
        with ThreadPoolExecutor(streams) as ex:
            total = sum(ex.map(read, shards))
        out[f"pfs_Bps_{streams}"] = total / (time.perf_counter() - t)
    drop()
    t = time.perf_counter()
    for p in shards:
        os.close(os.open(p, os.O_RDONLY))
    out["pfs_open_s"] = (time.perf_counter() - t) / len(shards)
    out["pfs_Bps"], out["pfs_streams"] = out["pfs_Bps_8"], 8
    return out


def status(net: Net, k: int, rt: str) -> dict[str, Any]:
    p = subprocess.run(["ip", "netns", "exec", net.ns[k], sys.executable, "-m", "stagefs.cli",
                        "status", "--runtime", rt, "--json"], capture_output=True, text=True,
                       timeout=120)
    return json.loads(p.stdout) if p.stdout.strip() else {}


class Partition:
    """Cuts ``nodes`` off from the rest once triggered, connects them again ``seconds``
    later, and records what each side saw: the cut-off nodes' and node 0's status a few
    seconds before the partition heals, and how long after it heals every node sees every
    other live again (``rejoin_s``)."""

    def __init__(self, net: Net, nodes: list[int], seconds: float, rt: Callable[[int], str]
                 ) -> None:
        self.net, self.nodes, self.seconds, self.rt = net, nodes, seconds, rt
        self.cut_at: float | None = None
        self.healed_at: float | None = None
        self.rejoin_s: float | None = None
        self._pool = ThreadPoolExecutor(len(nodes) + 1)
        self._during: dict[int, Future[dict[str, Any]]] | None = None

    def _own(self, k: int) -> dict[str, Any]:
        """Node k's own STATUS, asked in its namespace (3 s for the peers it cannot reach)."""
        nodes = status(self.net, k, self.rt(k)).get("nodes", [])
        return nodes[k] if k < len(nodes) and nodes[k] else {}

    def tick(self, triggered: bool) -> None:
        now = time.monotonic()
        if self.cut_at is None:
            if triggered:
                for k in self.nodes:
                    self.net.cut(k, True)
                self.cut_at = now
            return
        if self._during is None and now >= self.cut_at + max(self.seconds - 4, self.seconds / 2):
            self._during = {k: self._pool.submit(self._own, k) for k in [0, *self.nodes]}
        if self.healed_at is None and now >= self.cut_at + self.seconds:
            self.heal()

    def heal(self) -> None:
        for k in self.nodes:
            self.net.cut(k, False)
        self.healed_at = time.monotonic()

    def finish(self, timeout: float = 60.0) -> None:
        """The readers are done: heal (after the whole partition) if not yet, then wait
        until node 0 reaches every node and no node counts another dead."""
        if self.cut_at is None:
            return
        while self.healed_at is None:
            self.tick(True)
            time.sleep(0.05)
        while time.monotonic() < self.healed_at + timeout:
            nodes = status(self.net, 0, self.rt(0)).get("nodes", [])
            if nodes and all(x and not x["rereplication"]["dead"] for x in nodes):
                self.rejoin_s = time.monotonic() - self.healed_at
                return
            time.sleep(0.5)

    def during(self) -> dict[int, dict[str, Any]]:
        got = {k: f.result() for k, f in (self._during or {}).items()}
        self._pool.shutdown()
        return got


def partition_report(p: Partition, got: list[dict[str, Any]], final: list[dict[str, Any]],
                     ) -> dict[str, Any]:
    """What the cut-off nodes did: their readers' fallbacks to the origin and errors, their
    daemons' view (isolated or not, whom they took for dead, what they re-replicated), the
    other side's, and the time to rejoin."""
    assert p.cut_at is not None and p.healed_at is not None
    during = p.during()

    def daemon(x: dict[str, Any]) -> dict[str, Any]:
        r, fab = x.get("rereplication", {}), x.get("fabric", {})
        return {**{k: r.get(k) for k in ("isolated", "dead", "from_peers_bytes",
                                         "from_origin_bytes", "shards_copied")},
                "relay": fab.get("relay"), "relay_hedged": fab.get("hedged")}

    def reader(g: dict[str, Any]) -> dict[str, Any]:
        return {"origin_bytes": g["origin_bytes"], "errors": g["errors"], "wrong": g["wrong"],
                "hedged": g["hedged"], "epochs_s": [e["seconds"] for e in g["epochs"]],
                "stall_s": [e["stall"] for e in g["epochs"]],
                "relay_failures": (g["fabric"] or {}).get("failures")}

    start0 = got[0]["epochs"][0]["start"]
    others = [g for k, g in enumerate(got) if k not in p.nodes]
    return {
        "nodes": p.nodes, "seconds": p.seconds,
        "cut_at_s": p.cut_at - start0, "healed_at_s": p.healed_at - start0,  # from epoch 1
        "epoch_starts_s": [e["start"] - start0 for e in got[0]["epochs"]],
        "rejoin_s": p.rejoin_s,
        "cut_off": {k: {"reader": reader(got[k]), "daemon_during": daemon(during.get(k, {})),
                        "daemon_after": daemon(final[k] if k < len(final) and final[k]
                                               else {})} for k in p.nodes},
        "others": {"reader_origin_bytes": sum(g["origin_bytes"] for g in others),
                   "reader_errors": sum(g["errors"] + g["wrong"] for g in others),
                   "hedged": sum(g["hedged"] for g in others),
                   "node0_during": daemon(during.get(0, {})),
                   "rereplicated_from_peers_bytes": sum(
                       (x or {}).get("rereplication", {}).get("from_peers_bytes", 0)
                       for k, x in enumerate(final) if k not in p.nodes),
                   "rereplicated_from_origin_bytes": sum(
                       (x or {}).get("rereplication", {}).get("from_origin_bytes", 0)
                       for k, x in enumerate(final) if k not in p.nodes)},
    }


def run_one(n: int, s: Settings, origin: str, work: str, calibrate: bool = False) -> RunResult:
    res = RunResult(nodes=n, origin=origin)
    os.makedirs(work, exist_ok=True)
    pack, paths, res.dataset_bytes = make_dataset(origin, s, n)
    with open(os.path.join(work, "paths.json"), "w") as f:
        json.dump(list(paths), f)
    with open(os.path.join(work, "digests.json"), "w") as f:
        json.dump(paths, f)
    with open(os.path.join(work, "hosts"), "w") as f:
        f.write("".join(f"{node_ip(k)}:{PORT}\n" for k in range(n)))
    token = os.path.join(work, "token")
    subprocess.run([sys.executable, "-m", "stagefs.cli", "serve", "--new-token", token],
                   check=True, capture_output=True, timeout=60)
    shm = f"/dev/shm/stagefs-emu/{n}"
    shutil.rmtree(shm, ignore_errors=True)
    tier_bytes = 4 * s.replicas * s.samples_per_node * s.sample_kib * 1024 + 64 * 2**20
    res.load_before = loadavg()
    with Net(n, s.rate_mbit) as net, Sampler() as sampler:
        t0 = time.monotonic()
        daemons = [net.run(k, [sys.executable, "-m", "stagefs.cli", "serve", pack,
                               "--hosts", os.path.join(work, "hosts"), "--rank", str(k),
                               "--token-file", token, "--replicas", str(s.replicas),
                               "--tier", f"{shm}/n{k}/mem:{tier_bytes}",
                               "--runtime", f"{shm}/rt{k}", "--wait", "--progress", "0",
                               "--dead-after", str(s.dead_after)],
                           os.path.join(work, f"daemon{k}.log")) for k in range(n)]
        try:
            deadline = time.monotonic() + 600
            while not all(os.path.exists(f"{shm}/rt{k}/cluster.json") for k in range(n)):
                dead = [k for k, d in enumerate(daemons) if d.poll() is not None]
                if dead or time.monotonic() > deadline:
                    raise SystemExit(f"N={n}: daemons {dead or 'slow'} did not stage; see "
                                     f"{work}/daemon*.log")
                time.sleep(0.05)
            res.staging_s = time.monotonic() - t0
            st = status(net, 0, f"{shm}/rt0")
            res.staging_origin_bytes = sum(x["staging"]["origin_bytes"]
                                           for x in st.get("nodes", []) if x)
            res.staging_origin_meta = sum(x["staging"].get("origin_opens", 0)
                                          + x["staging"].get("origin_stats", 0)
                                          for x in st.get("nodes", []) if x)
            if calibrate:
                res.calibration.update(calibrate_origin(pack))
                if n > 1:
                    res.calibration.update(calibrate_net(net, work))
            sampler.pids["daemons"] = [d.pid for d in daemons]
            # the daemons' background work (probes, housekeeping): staged, no reader yet
            i0 = [cpu_seconds(d.pid) for d in daemons]
            time.sleep(s.idle_s)
            res.daemon_idle_cpu_per_s = statistics.fmean(
                cpu_seconds(d.pid) - c for d, c in zip(daemons, i0, strict=True)) / s.idle_s
            before = {x["rank"]: x["server"]["requests"] + x["server"]["relayed_requests"]
                      for x in status(net, 0, f"{shm}/rt0").get("nodes", []) if x}
            cpu0 = [cpu_seconds(d.pid) for d in daemons]
            bar = os.path.join(work, "barrier")
            os.makedirs(bar, exist_ok=True)
            victim = n - 1 if s.kill and n > 1 else None
            half = os.path.join(work, "half")
            cut = Partition(net, s.cut_off(n), s.partition, lambda k: f"{shm}/rt{k}")
            # a partition starts halfway through the first epoch, so that the epochs after
            # it read from the nodes that rejoined; a kill, halfway through the last
            half_epoch = 0 if cut.nodes else s.epochs - 1
            readers = [net.run(k, [sys.executable, READER, "--runtime", f"{shm}/rt{k}",
                                   "--rank", str(k), "--nodes", str(n),
                                   "--paths", os.path.join(work, "paths.json"),
                                   "--batch", str(s.batch), "--compute-ms", str(s.compute_ms),
                                   "--prefetch", str(s.prefetch), "--epochs", str(s.epochs),
                                   "--seed", str(s.seed), "--barrier", bar,
                                   "--out", os.path.join(work, f"reader{k}.json"),
                                   "--digests", os.path.join(work, "digests.json"),
                                   *([] if s.epoch_ahead else ["--no-epoch-ahead"]),
                                   *(["--half", f"{half_epoch}:{half}"] if k == 0 else [])],
                               os.path.join(work, f"reader{k}.log")) for k in range(n)]
            sampler.pids["readers"] = [r.pid for r in readers]
            conns: list[int] = []
            while any(r.poll() is None for r in readers):
                if victim is not None and res.killed is None and os.path.exists(half):
                    os.kill(daemons[victim].pid, signal.SIGKILL)
                    res.killed = victim
                if cut.nodes:
                    cut.tick(os.path.exists(half))
                if len(conns) < n:  # once the readers run: each node's connections
                    time.sleep(1.0)
                    conns = [net.connections(k) for k in range(n)]
                time.sleep(0.05)
            cut.finish()
            cpu = [cpu_seconds(d.pid) for d in daemons if d.poll() is None]
            res.daemon_cpu_s = statistics.fmean(cpu) if cpu else 0.0
            res.epoch_daemon_cpu_s = statistics.fmean(
                cpu_seconds(d.pid) - c0 for d, c0 in zip(daemons, cpu0, strict=True)
                if d.poll() is None)
            st = status(net, 0, f"{shm}/rt0")
            live = [x for x in st.get("nodes", []) if x]
            res.requests = sum(x["server"]["requests"] + x["server"]["relayed_requests"]
                               - before.get(x["rank"], 0) for x in live)
            res.tcp_peak_per_peer = max((x["server"]["tcp_peak"] for x in live), default=0) / max(
                n - 1, 1)
            res.connections_max, res.connections_mean = max(conns), statistics.fmean(conns)
            got = []
            for k, r in enumerate(readers):
                if r.returncode != 0:
                    raise SystemExit(f"N={n}: reader {k} failed; see {work}/reader{k}.log")
                with open(os.path.join(work, f"reader{k}.json")) as f:
                    got.append(json.load(f))
            sampler.sample()
            for e in range(s.epochs):
                res.epochs_s.append(max(g["epochs"][e]["seconds"] for g in got))
                res.stall_s.append(statistics.fmean(g["epochs"][e]["stall"] for g in got))
                res.node_epochs_s.append([round(g["epochs"][e]["seconds"], 3) for g in got])
                res.node_stall_s.append([round(g["epochs"][e]["stall"], 3) for g in got])
                res.node_reader_cpu.append([round(g["epochs"][e]["cpu_s"], 3) for g in got])
                w = sampler.window(min(g["epochs"][e]["start"] for g in got),
                                   max(g["epochs"][e]["start"] + g["epochs"][e]["seconds"]
                                       for g in got))
                res.host_busy_cores.append(w["host_busy_cores"])
                res.ours_cores.append(w["ours_cores"])
                res.others_cores.append(w["host_busy_cores"] - w["ours_cores"])
                res.epoch_daemon_cpu.append(w["daemons_cpu"] / n)
                res.epoch_reader_cpu.append(w["readers_cpu"] / n)
            res.batches = got[0]["epochs"][-1]["batches"]
            res.node_peer_connects = [g.get("peer_connects", 0) for g in got]
            if res.killed is not None and s.epochs > 1:
                # the lost node's reader: with its daemon gone it connects to each peer it
                # reads from (a connect, a token exchange): its extra CPU per connection
                v = res.killed
                extra = res.node_reader_cpu[-1][v] - res.node_reader_cpu[-2][v]
                res.calibration["connect_s"] = max(extra, 0.0) / max(
                    res.node_peer_connects[v], 1)
            if calibrate and res.requests:
                # the daemons' CPU during the epochs: their background work (per daemon and
                # second, measured idle) and the rest per request served or relayed; the
                # readers' own CPU (their Python, the fabric client) per batch
                span = sum(statistics.fmean(g["epochs"][e]["seconds"] for g in got)
                           for e in range(s.epochs))
                work_cpu = sum(res.epoch_daemon_cpu) * n - res.daemon_idle_cpu_per_s * n * span
                per = max(work_cpu, 0.0) / res.requests
                res.calibration.update({
                    "req_s": per, "relay_s": per, "byte_s": 0.0,
                    "daemon_bg_s": res.daemon_idle_cpu_per_s,
                    "reader_batch_s": statistics.fmean(res.epoch_reader_cpu) / res.batches})
            res.reader_origin_bytes = sum(g["origin_bytes"] for g in got)
            res.reader_errors = sum(g["errors"] for g in got)
            res.wrong_samples = sum(g["wrong"] for g in got)
            res.checksum_failures = sum(g["checksum_failures"] for g in got)
            if cut.cut_at is not None:
                res.partition = partition_report(cut, got, st.get("nodes", []))
            res.reader_cpu_s = statistics.fmean(g["cpu_s"] for g in got)
        finally:
            for d in daemons:
                if d.poll() is None:
                    d.send_signal(signal.SIGTERM)
            for d in daemons:
                try:
                    d.wait(30)
                except subprocess.TimeoutExpired:
                    d.kill()
            shutil.rmtree(shm, ignore_errors=True)
            shutil.rmtree(pack, ignore_errors=True)
            with contextlib.suppress(OSError):  # the runs' parent, once the last one is gone
                os.rmdir(os.path.dirname(shm))
    res.load_after = loadavg()
    return res


def efficiency(results: list[RunResult]) -> list[dict[str, Any]]:
    base = next((r for r in results if r.nodes == 1), results[0])
    rows = []
    for r in results:
        row = asdict(r)
        row["efficiency"] = [b / t if t else 0.0 for b, t in zip(base.epochs_s, r.epochs_s,
                                                                 strict=True)]
        row["staging_origin_ratio"] = r.staging_origin_bytes / max(r.dataset_bytes, 1)
        rows.append(row)
    return rows


def render(rows: list[dict[str, Any]], s: Settings) -> str:
    head = ["nodes", "staging s", "origin/dataset", "origin meta ops", "epoch s (last)",
            "efficiency (last)",
            "stall s", "reader origin B", "TCP conns/peer", "daemon cpu s", "errors"]
    body = [[str(r["nodes"]), f"{r['staging_s']:.1f}", f"{r['staging_origin_ratio']:.3f}",
             str(r["staging_origin_meta"]), f"{r['epochs_s'][-1]:.2f}", f"{r['efficiency'][-1]:.3f}",
             f"{r['stall_s'][-1]:.2f}", str(r["reader_origin_bytes"]),
             f"{r['connections_max'] / max(2 * (r['nodes'] - 1), 1):.1f}",
             f"{r['daemon_cpu_s']:.1f}",
             str(r["reader_errors"] + r["checksum_failures"] + r["wrong_samples"])]
            for r in rows]
    scale = s.real_link_gbit * 1000 / s.rate_mbit
    return (table(head, body) + f"\nlinks {s.rate_mbit} Mbit/s each (a real node's "
            f"{s.real_link_gbit:g} Gbit/s scaled by 1/{scale:.0f}); demand per node "
            f"{s.demand_mbit():.1f} Mbit/s; {s.samples_per_node} samples of {s.sample_kib} "
            f"KiB per node, batch {s.batch} ({-(-s.samples_per_node // s.batch)} steps an "
            f"epoch), compute {s.compute_ms:g} ms, prefetch "
            f"{s.prefetch}, replicas {s.replicas}")


def plot(rows: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ns = [r["nodes"] for r in rows]
    for e in range(len(rows[0]["efficiency"])):
        ax.plot(ns, [r["efficiency"][e] for r in rows], marker="o", label=f"epoch {e + 1}")
    ax.axhline(0.9, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("nodes (emulated)")
    ax.set_ylabel("weak-scaling efficiency")
    ax.set_ylim(0, 1.1)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    d = Settings()
    for f in ("samples_per_node", "sample_kib", "batch", "prefetch", "epochs", "replicas",
              "seed"):
        ap.add_argument("--" + f.replace("_", "-"), type=int, default=getattr(d, f))
    for f in ("compute_ms", "rate_mbit", "dead_after"):
        ap.add_argument("--" + f.replace("_", "-"), type=float, default=getattr(d, f))
    ap.add_argument("--no-epoch-ahead", dest="epoch_ahead", action="store_false",
                    help="readers start each epoch's read-ahead at its barrier, not before")
    ap.add_argument("--kill", action="store_true", help="kill one daemon mid last epoch")
    ap.add_argument("--partition", type=float, default=0.0, metavar="SECONDS",
                    help="cut some nodes off from the others for SECONDS from the middle of "
                         "the first epoch, then connect them again")
    ap.add_argument("--partition-nodes", type=int, default=0, metavar="K",
                    help="how many nodes the partition cuts off (the last K; default N/4)")
    ap.add_argument("--origin", default=None, help="default: /tmp/pfs if mounted")
    ap.add_argument("--out", default=None, help="a directory for emulated.json/.png")
    ap.add_argument("--tag", default="", help="a suffix for the result files' names")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("emucluster: needs root (network namespaces, tc)", file=sys.stderr)
        return 2
    s = Settings(**{f: getattr(a, f) for f in ("samples_per_node", "sample_kib", "batch",
                                                "prefetch", "epochs", "replicas", "seed",
                                                "compute_ms", "rate_mbit", "dead_after",
                                                "kill", "partition", "partition_nodes",
                                                "epoch_ahead")})
    if s.kill and s.partition:
        ap.error("--kill and --partition: one fault a run")
    origin = a.origin or ("/tmp/pfs" if os.path.ismount("/tmp/pfs") else None)
    scratch: list[str] = []  # removed once every run has ended well; kept (logs) otherwise
    if origin is None:
        origin = tempfile.mkdtemp(prefix="emu-origin-")
        scratch.append(origin)
        print(f"emucluster: no test PFS mounted; origin {origin} (local disk)")
    work = tempfile.mkdtemp(prefix="emucluster-")
    scratch.append(work)
    try:
        results = _runs(a, s, origin, work)
    except BaseException:
        print(f"emucluster: the daemons' and readers' logs are in {work}", file=sys.stderr)
        raise
    for path in scratch:
        shutil.rmtree(path, ignore_errors=True)
    rows = efficiency(results)
    print(render(rows, s))
    if a.out:
        save(a.out, s, results, a.tag)
        plot(rows, os.path.join(a.out, f"emulated{kind(s)}{a.tag}.png"))
    return 0


def _runs(a: argparse.Namespace, s: Settings, origin: str, work: str) -> list[RunResult]:
    """One run for each of ``a.nodes``, each saved as it ends (a long run cut short keeps
    what it measured)."""
    results: list[RunResult] = []
    for n in a.nodes:
        # the constants of the model (scale_sim.py): at one node (the origin, local reads)
        # and at the smallest N > 1 (latency, a link, the daemons' cost per request)
        cal = n == min(a.nodes) or n == min((m for m in a.nodes if m > 1), default=0)
        r = run_one(n, s, origin, os.path.join(work, f"n{n}"), calibrate=cal)
        print(f"N={n}: staged in {r.staging_s:.1f} s, epochs {[round(x, 2) for x in r.epochs_s]}"
              f" s, connections max {r.connections_max}; host busy "
              f"{[round(x, 2) for x in r.host_busy_cores]} cores (ours "
              f"{[round(x, 2) for x in r.ours_cores]}), load before {r.load_before[0]:.2f} "
              f"after {r.load_after[0]:.2f}", flush=True)
        if r.partition:
            print(partition_summary(r), flush=True)
        results.append(r)
        if a.out:
            save(a.out, s, results, a.tag)
    return results


def kind(s: Settings) -> str:
    return "-kill" if s.kill else "-partition" if s.partition else ""


def partition_summary(r: RunResult) -> str:
    p = r.partition
    lines = [f"N={r.nodes}: nodes {p['nodes']} cut off at {p['cut_at_s']:.1f} s for "
             f"{p['seconds']:g} s (epochs start at "
             f"{', '.join(f'{t:.1f}' for t in p['epoch_starts_s'])} s); every node sees every "
             f"other live {p['rejoin_s'] if p['rejoin_s'] is None else round(p['rejoin_s'], 1)}"
             f" s after it healed"]
    for k, c in p["cut_off"].items():
        rd, dd = c["reader"], c["daemon_during"]
        lines.append(f"  cut-off node {k}: reader read {rd['origin_bytes']} B from the origin, "
                     f"{rd['errors']} errors, {rd['wrong']} wrong samples, epochs "
                     f"{[round(x, 2) for x in rd['epochs_s']]} s; its daemon during the cut: "
                     f"isolated={dd.get('isolated')}, dead={dd.get('dead')}, re-replicated "
                     f"{dd.get('from_origin_bytes')} B from the origin; its relays after the "
                     f"cut: {(c['daemon_after'].get('relay') or {})}")
    o = p["others"]
    lines.append(f"  the others: readers read {o['reader_origin_bytes']} B from the origin, "
                 f"{o['reader_errors']} errors; node 0 during the cut: dead="
                 f"{o['node0_during'].get('dead')}; re-replicated {o['rereplicated_from_peers_bytes']}"
                 f" B from peers, {o['rereplicated_from_origin_bytes']} B from the origin")
    return "\n".join(lines)


def save(out_dir: str, s: Settings, results: list[RunResult], tag: str = "") -> None:
    calibration: dict[str, float] = {}
    for r in results:
        calibration.update(r.calibration)
    os.makedirs(out_dir, exist_ok=True)
    name = f"emulated{kind(s)}{tag}.json"
    with open(os.path.join(out_dir, name), "w") as out:
        json.dump({"settings": asdict(s), "calibration": calibration,
                   "runs": efficiency(results)}, out, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
