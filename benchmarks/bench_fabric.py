"""Fabric benchmark: fan-in of many reader processes onto per-node daemons, and batched peer
reads (direct and through the node daemon) against a raw socket loop moving the same bytes.

1. Fan-in. ``--nodes`` daemons (static bootstrap, replicas 1, their own processes) on this
   machine; on each node ``--ranks`` training processes, each forking ``--workers``
   DataLoader-like workers; every process reads its share of the dataset with read_many
   (32 samples per call, verified). Once through the node fabric (the default) and once with
   ``STAGEFS_FABRIC=0`` (every process its own pool to every peer, as before): per daemon
   the most TCP connections at once, refused connections, and origin fallbacks.
2. Batched peer reads. From node 0, every sample held on the other nodes, 64 per request:
   through node 0's daemon (``fabric.sock``: relayed to all peers at once, verified by the
   reader as the Store does), directly to each holder's daemon (``PeerClient``, TCP), and a
   raw socket loop moving the same byte counts from another process (request = the list of
   ranges, reply = those bytes sliced out of the shards in memory, scatter sendmsg; no
   framing, no authentication, no checksum): the limit; and the same loop hashing each
   sample as it arrives (the check every other row makes), the limit for verified reads;
   and that checked loop through one more hop (a forwarder process that passes each request
   on over TCP and splices the reply's bytes to the reader's Unix socket, 1 MiB at a time):
   what a relay's second hop itself costs on this machine.
3. A batch spanning all peers, through the fabric: its wall time against the slowest single
   peer's part sent alone (1.0 = parallel; the number of peers = serial).

    python benchmarks/bench_fabric.py --files 2000 --runs 5 --out benchmarks/results

Figures are medians of --runs, printed as tables and saved to fabric.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench_cluster import RAW_SERVER, make_pack, stop
from xxhash import xxh3_64_intdigest

from stagefs._table import table
from stagefs.cluster.placement import place
from stagefs.cluster.status import cluster_status
from stagefs.format import Manifest
from stagefs.net.client import PeerClient

BATCH = 64

# the raw loop through one more hop: a forwarder that takes a reader's request on a Unix
# socket, passes it to a raw server over TCP, and splices the reply's bytes on to the reader
# 1 MiB at a time (no framing, no Python per range): what a relay's second hop costs here
RAW_FORWARDER = r"""
import fcntl, os, socket, struct, sys
up = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
ls = socket.socket(socket.AF_UNIX); ls.bind(sys.argv[2]); ls.listen(1); print("ok", flush=True)
c, _ = ls.accept()
r, w = os.pipe(); fcntl.fcntl(w, 1031, 1 << 20)
rng = struct.Struct("!IQI")
while True:
    h = c.recv(4, socket.MSG_WAITALL)
    if len(h) < 4:
        break
    body = c.recv(struct.unpack("!I", h)[0] * rng.size, socket.MSG_WAITALL)
    up.sendall(h + body)
    left = sum(k for _, _, k in rng.iter_unpack(body))
    while left:
        got = os.splice(up.fileno(), w, min(left, 1 << 20))
        left -= got
        while got:
            got -= os.splice(r, c.fileno(), got)
"""

RANK = r"""
import json, multiprocessing as mp, os, sys
import stagefs
work, node, rank, ranks, workers, nodes = sys.argv[1], *map(int, sys.argv[2:7])
fs = stagefs.connect(os.path.join(work, f"rt{node}"), timeout=60)
files = [os.path.join(d, f) for d, _, fl in fs.walk("") for f in fl]
files.sort()
def run(slot, q):
    mine = files[slot :: nodes * ranks * (workers + 1)]
    for i in range(0, len(mine), 32):
        fs.read_many(mine[i : i + 32])
    st = fs.status()
    q.put({"origin_bytes": st["origin"]["bytes_read"],
           "peer_connects": sum(v["connects"] for v in st["peers"].values())})
base = (node * ranks + rank) * (workers + 1)
ctx = mp.get_context("fork")
q = ctx.Queue()
procs = [ctx.Process(target=run, args=(base + 1 + w, q)) for w in range(workers)]
for p in procs:
    p.start()
run(base, q)
out = [q.get(timeout=600) for _ in range(workers + 1)]
for p in procs:
    p.join(60)
with open(os.path.join(work, f"rank{node}-{rank}.json"), "w") as f:
    json.dump(out, f)
"""


def _json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def start_cluster(work: str, pack: str, nodes: int, env: dict[str, str] | None = None
                  ) -> list[subprocess.Popen[bytes]]:
    ports = []
    for _ in range(nodes):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        ports.append(s.getsockname()[1])
        s.close()
    with open(os.path.join(work, "hosts"), "w") as f:
        f.write("".join(f"127.0.0.1:{p}\n" for p in ports))
    if not os.path.exists(os.path.join(work, "token")):
        subprocess.run([sys.executable, "-m", "stagefs.cli", "serve", "--new-token",
                        os.path.join(work, "token")], check=True, capture_output=True)
    daemons = [subprocess.Popen(
        [sys.executable, "-m", "stagefs.cli", "serve", pack, "--tier",
         os.path.join(work, f"node{r}") + ":4GiB", "--runtime", os.path.join(work, f"rt{r}"),
         "--hosts", os.path.join(work, "hosts"), "--rank", str(r), "--token-file",
         os.path.join(work, "token"), "--wait", "--progress", "0"],
        start_new_session=True, stderr=subprocess.DEVNULL,
        env=None if env is None else {**os.environ, **env}) for r in range(nodes)]
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if all(_json(os.path.join(work, f"rt{r}", "cluster.json"))["staged"]
                   for r in range(nodes)):
                return daemons
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise RuntimeError("the cluster did not stage in time")


# -- 1. fan-in -------------------------------------------------------------------------------

def fan_in(work: str, pack: str, nodes: int, ranks: int, workers: int, fabric: bool
           ) -> dict[str, Any]:
    daemons = start_cluster(work, pack, nodes)
    try:
        env = {**os.environ, "STAGEFS_FABRIC": "1" if fabric else "0"}
        t0 = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-c", RANK, work, str(n), str(r),
                                   str(ranks), str(workers), str(nodes)], env=env)
                 for n in range(nodes) for r in range(ranks)]
        codes = [p.wait(1800) for p in procs]
        took = time.perf_counter() - t0
        _, status = cluster_status(os.path.join(work, "rt0"))
        per = []
        for n in range(nodes):
            rows = [x for r in range(ranks)
                    for x in _json(os.path.join(work, f"rank{n}-{r}.json"))]
            s = status[n] or {"server": {}}
            per.append({"tcp_peak": s["server"].get("tcp_peak"),
                        "unix_peak": s["server"].get("unix_peak"),
                        "refused": s["server"].get("refused_busy"),
                        "origin_bytes": sum(x["origin_bytes"] for x in rows),
                        "reader_peer_connects": sum(x["peer_connects"] for x in rows)})
        return {"fabric": fabric, "seconds": took, "exit_codes": codes, "nodes": per,
                "processes": nodes * ranks * (workers + 1)}
    finally:
        for d in daemons:
            stop(d)
        for n in range(nodes):
            shutil.rmtree(os.path.join(work, f"node{n}"), ignore_errors=True)


# -- 2. and 3. batched peer reads ------------------------------------------------------------

def peer_reads(work: str, pack: str, nodes: int, runs: int) -> dict[str, Any]:
    daemons = start_cluster(work, pack, nodes)
    raw, raw2 = (subprocess.Popen([sys.executable, "-c", RAW_SERVER, pack],
                                  stdout=subprocess.PIPE, start_new_session=True)
                 for _ in range(2))
    fwd: subprocess.Popen[bytes] | None = None
    try:
        with open(os.path.join(work, "token")) as f:
            token = bytes.fromhex(f.read().strip())
        m = Manifest(os.path.join(pack, "manifest.sfm"))
        holder = [h[0] for h in place(len(m.shards), nodes, 1).holders]
        ents = [e for e in m.files() if holder[m.shard[e]] != 0]
        ranges = [(int(m.shard[e]), int(m.offset[e]), int(m.stored[e])) for e in ents]
        sums = [int(m.checksum[e]) for e in ents]
        nbytes = sum(r[2] for r in ranges)
        with open(os.path.join(work, "hosts")) as f:
            hosts = [line.strip().rsplit(":", 1) for line in f]
        fabric = PeerClient("", 0, token, unix=os.path.join(work, "rt0", "fabric.sock"),
                            pack_id=m.pack_id)
        direct = {n: PeerClient(h, int(p), token, pack_id=m.pack_id)
                  for n, (h, p) in enumerate(hosts) if n}
        assert raw.stdout is not None
        rs = socket.create_connection(("127.0.0.1", int(raw.stdout.readline())))
        assert raw2.stdout is not None
        fwd_path = os.path.join(work, "forwarder.sock")
        port2 = raw2.stdout.readline().decode().strip()
        fwd = subprocess.Popen([sys.executable, "-c", RAW_FORWARDER, port2, fwd_path],
                               stdout=subprocess.PIPE, start_new_session=True)
        assert fwd.stdout is not None
        fwd.stdout.readline()
        hop = socket.socket(socket.AF_UNIX)
        hop.connect(fwd_path)
        rs.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rview = memoryview(bytearray(256 * 2**20))

        def check(out: list[bytes | None], idx: range) -> None:
            for d, i in zip(out, idx, strict=True):
                if d is None or xxh3_64_intdigest(d) != sums[i]:
                    raise RuntimeError("a peer read returned wrong bytes")

        def fabric_epoch() -> None:
            for i in range(0, len(ranges), BATCH):
                check(fabric.read(ranges[i : i + BATCH]), range(i, min(i + BATCH, len(ranges))))

        def direct_epoch() -> None:
            for n, c in direct.items():
                idx = [i for i, r in enumerate(ranges) if holder[r[0]] == n]
                for k in range(0, len(idx), BATCH):
                    part = idx[k : k + BATCH]
                    out = c.read([ranges[i] for i in part])
                    for d, i in zip(out, part, strict=True):
                        if d is None or xxh3_64_intdigest(d) != sums[i]:
                            raise RuntimeError("a peer read returned wrong bytes")

        def raw_epoch(check: bool = False, rs: socket.socket = rs) -> None:
            """The raw loop; with ``check``, each sample's xxh3 against the manifest's as
            it arrives (the check every other row makes); ``rs``: to the raw server, or
            to the forwarder in front of another."""
            for i in range(0, len(ranges), BATCH):
                batch = ranges[i : i + BATCH]
                rs.sendall(len(batch).to_bytes(4, "big")
                           + b"".join(struct.pack("!IQI", *r) for r in batch))
                n, got = sum(r[2] for r in batch), 0
                while got < n:
                    got += rs.recv_into(rview[got:n], n - got)
                pos = 0
                for k, r in enumerate(batch if check else ()):
                    if xxh3_64_intdigest(rview[pos : pos + r[2]]) != sums[i + k]:
                        raise RuntimeError("the raw loop returned wrong bytes")
                    pos += r[2]

        def raw_checked_epoch() -> None:
            raw_epoch(check=True)

        def raw_two_hops_epoch() -> None:
            raw_epoch(check=True, rs=hop)

        times: dict[str, list[float]] = {"fabric": [], "direct": [], "raw": [],
                                         "raw_checked": [], "raw_two_hops": []}
        fabric_epoch()
        direct_epoch()
        raw_epoch()
        raw_checked_epoch()
        raw_two_hops_epoch()
        for _ in range(runs):
            for name, fn in (("fabric", fabric_epoch), ("direct", direct_epoch),
                             ("raw", raw_epoch), ("raw_checked", raw_checked_epoch),
                             ("raw_two_hops", raw_two_hops_epoch)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        # 3. one batch over every peer against each peer's part alone (through the fabric)
        per_peer = {n: [r for r in ranges if holder[r[0]] == n][:BATCH] for n in direct}
        spanning = [r for part in per_peer.values() for r in part]
        all_t, alone_t = [], []
        for _ in range(max(20, runs * 4)):
            t0 = time.perf_counter()
            fabric.read(spanning)
            all_t.append(time.perf_counter() - t0)
            slowest = 0.0
            for part in per_peer.values():
                t0 = time.perf_counter()
                fabric.read(part)
                slowest = max(slowest, time.perf_counter() - t0)
            alone_t.append(slowest)
        rs.close()
        hop.close()
        fabric.close()
        for c in direct.values():
            c.close()
        m.close()
    finally:
        for d in daemons:
            stop(d)
        for p in (raw, raw2, fwd):
            if p is not None:
                stop(p)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"samples": len(ranges), "bytes": nbytes, "batch": BATCH,
            **{f"{k}_s": v for k, v in med.items()},
            **{f"{k}_GBps": nbytes / v / 1e9 for k, v in med.items()},
            "fabric_vs_raw": med["raw"] / med["fabric"],
            "direct_vs_raw": med["raw"] / med["direct"],
            "fabric_vs_raw_checked": med["raw_checked"] / med["fabric"],
            "fabric_vs_raw_two_hops": med["raw_two_hops"] / med["fabric"],
            "direct_vs_raw_checked": med["raw_checked"] / med["direct"],
            "spanning_s": statistics.median(all_t), "slowest_alone_s": statistics.median(alone_t),
            "spanning_vs_slowest": statistics.median(all_t) / statistics.median(alone_t),
            "peers": len(direct), "load_average": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="stagefs-bench-fabric-", dir="/dev/shm")
    result: dict[str, Any] = {"command": " ".join(sys.argv), "runs": a.runs}
    try:
        pack, _ = make_pack(os.path.join(work, "data"), a.files, "16MiB")
        rows = []
        for fabric in (True, False):
            fi = fan_in(work, pack, a.nodes, a.ranks, a.workers, fabric)
            result["fan_in_fabric" if fabric else "fan_in_direct"] = fi
            for n, s in enumerate(fi["nodes"]):
                rows.append(["node fabric" if fabric else "direct (STAGEFS_FABRIC=0)", str(n),
                             str(s["tcp_peak"]), str(s["unix_peak"]), str(s["refused"]),
                             str(s["origin_bytes"]), str(s["reader_peer_connects"])])
        print(table([f"fan-in: {a.nodes} nodes x {a.ranks} ranks x {a.workers} workers",
                     "node", "TCP conns (peak)", "unix readers (peak)", "refused",
                     "origin bytes", "reader->peer connects"], rows))
        pr = peer_reads(work, pack, a.nodes, a.runs)
        result["peer_reads"] = pr
        print()
        print(table([f"batched peer reads from node 0 ({BATCH}/request, verified)", "GB/s",
                     "vs raw socket", "vs raw socket + the same check"], [
            ["through the node daemon (fabric.sock, relayed)", f"{pr['fabric_GBps']:.2f}",
             f"{pr['fabric_vs_raw']:.0%}", f"{pr['fabric_vs_raw_checked']:.0%}"],
            ["directly to each holder (TCP)", f"{pr['direct_GBps']:.2f}",
             f"{pr['direct_vs_raw']:.0%}", f"{pr['direct_vs_raw_checked']:.0%}"],
            ["raw socket loop, same bytes", f"{pr['raw_GBps']:.2f}", "100%", ""],
            ["raw socket loop + xxh3 of each sample", f"{pr['raw_checked_GBps']:.2f}", "",
             "100%"],
            ["raw loop + xxh3, through a splice forwarder (two hops)",
             f"{pr['raw_two_hops_GBps']:.2f}", "",
             f"{pr['raw_checked_s'] / pr['raw_two_hops_s']:.0%}"]]))
        print(f"through the node daemon against the raw two-hop loop: "
              f"{pr['fabric_vs_raw_two_hops']:.0%}")
        print(f"\na batch over all {pr['peers']} peers: {pr['spanning_s'] * 1e3:.1f} ms, the "
              f"slowest peer's part alone {pr['slowest_alone_s'] * 1e3:.1f} ms "
              f"(ratio {pr['spanning_vs_slowest']:.2f}; {pr['peers']} would be serial)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "fabric.json"), "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    print(f"\nsaved {os.path.join(a.out, 'fabric.json')}")


if __name__ == "__main__":
    main()
