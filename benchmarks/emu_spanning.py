"""A batch spanning every peer, where each peer's part costs time on its own wire.

On one host the parts of a batch cost CPU more than time on a wire (bench_fabric.py: four
daemons and the reader on 2 cores), so their overlap cannot show there. Here ``--peers``
daemons run in network namespaces (emucluster.py's ``Net``), each peer's link shaped to
``--rate-mbit`` both ways and node 0's (the reader's) to ``--reader-rate-mbit``, wider
than all the peers' together, as a reader's view of many peers each sending its share. The
dataset is placed with 1 replica, so each sample has one holder. A reader in node 0's
namespace asks node 0's daemon (fabric.sock: relayed to the holders) for ``--batch``
samples from every peer in one request, and for each peer's part alone; every sample is
checked against its digest. Reported: the spanning batch's wall time against the slowest
peer's part alone (1 is parallel, the number of peers serial), medians of ``--runs``.

Also, where the wire is the limit: peer 1's part read through node 0's daemon (relayed, the
readers' path), directly from peer 1's daemon (TCP), and by a raw socket loop from a
process in peer 1's namespace holding the shards in memory (request = the ranges, reply =
their bytes by scatter send; no framing, token or checksum), each over the same shaped
link, every sample checked: each path's throughput against the raw loop's.

    python benchmarks/emu_spanning.py --peers 3 --out benchmarks/results

Needs root (network namespaces, tc) and the test PFS as origin when mounted (else a local
directory).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

from bench_cluster import RAW_SERVER
from emucluster import PORT, Net, Settings, make_dataset, node_ip, sh

from stagefs._table import table

READER = r"""
import json, socket, statistics, struct, sys, time
from xxhash import xxh3_64_hexdigest
from stagefs.cluster.placement import place
from stagefs.format import Manifest
from stagefs.net.client import PeerClient

work, pack, rt, nodes, batch, runs = sys.argv[1:7]
nodes, batch, runs = int(nodes), int(batch), int(runs)
token = bytes.fromhex(open(f"{work}/token").read().strip())
digests = json.load(open(f"{work}/digests.json"))
m = Manifest(f"{pack}/manifest.sfm")
holder = [h[0] for h in place(len(m.shards), nodes, 1).holders]
parts = {}
for e in m.files():
    k = holder[int(m.shard[e])]
    if k and len(parts.setdefault(k, [])) < batch:
        parts[k].append((int(m.shard[e]), int(m.offset[e]), int(m.stored[e]),
                         m.path_of(e).decode()))
fab = PeerClient("", 0, token, unix=f"{rt}/fabric.sock", pack_id=m.pack_id)
peer_host, peer_port, raw_port = sys.argv[7], int(sys.argv[8]), int(sys.argv[9])
direct = PeerClient(peer_host, peer_port, token, pack_id=m.pack_id)
raw = socket.create_connection((peer_host, raw_port))
raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rbuf = memoryview(bytearray(256 * 2**20))

def read(items, client=fab):
    t0 = time.perf_counter()
    got = client.read([(s, o, n) for s, o, n, _ in items])
    dt = time.perf_counter() - t0
    for d, (_, _, _, p) in zip(got, items):
        if d is None or xxh3_64_hexdigest(d) != digests[p]:
            raise SystemExit(f"wrong or missing bytes for {p}")
    return dt

def read_raw(items):
    t0 = time.perf_counter()
    raw.sendall(len(items).to_bytes(4, "big")
                + b"".join(struct.pack("!IQI", s, o, n) for s, o, n, _ in items))
    total, got = sum(x[2] for x in items), 0
    while got < total:
        k = raw.recv_into(rbuf[got:total], total - got)
        if not k:
            raise SystemExit("the raw loop's server closed")
        got += k
    dt = time.perf_counter() - t0
    pos = 0
    for _, _, n, p in items:
        if xxh3_64_hexdigest(rbuf[pos : pos + n]) != digests[p]:
            raise SystemExit(f"the raw loop returned wrong bytes for {p}")
        pos += n
    return dt

missing = [k for k in range(1, nodes) if len(parts.get(k, ())) < batch]
if missing:
    raise SystemExit(f"peers {missing} hold fewer than {batch} samples")
spanning = [x for k in sorted(parts) for x in parts[k]]
read(spanning)  # warm: connections made
span_t, alone_t = [], []
for _ in range(runs):
    span_t.append(read(spanning))
    alone_t.append(max(read(parts[k]) for k in sorted(parts)))
# peer 1's part over its shaped link: relayed, direct, raw (each warmed first)
one = parts[1]
wire = {"relayed": [], "direct": [], "raw": []}
read(one, direct), read_raw(one)
for _ in range(runs):
    wire["relayed"].append(read(one))
    wire["direct"].append(read(one, direct))
    wire["raw"].append(read_raw(one))
med = {k: statistics.median(v) for k, v in wire.items()}
print(json.dumps({"peers": len(parts), "samples_per_part": batch,
                  "part_bytes": sum(x[2] for x in parts[min(parts)]),
                  "spanning_s": statistics.median(span_t),
                  "slowest_alone_s": statistics.median(alone_t),
                  "one_peer_s": med, "one_peer_bytes": sum(x[2] for x in one),
                  "relayed_vs_raw": med["raw"] / med["relayed"],
                  "direct_vs_raw": med["raw"] / med["direct"]}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--rate-mbit", type=float, default=200.0, help="each peer's link")
    ap.add_argument("--reader-rate-mbit", type=float, default=0.0,
                    help="node 0's link (default: 2 x the peers' together)")
    ap.add_argument("--batch", type=int, default=16, help="samples from each peer")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--origin", default=None, help="default: /tmp/pfs if mounted")
    ap.add_argument("--out", default=None, help="a directory for spanning.json")
    a = ap.parse_args()
    n = a.peers + 1
    origin = a.origin or ("/tmp/pfs" if os.path.ismount("/tmp/pfs") else
                          tempfile.mkdtemp(prefix="emu-origin-"))
    reader_rate = a.reader_rate_mbit or 2 * a.peers * a.rate_mbit
    # enough 4 MiB shards that every peer holds some (64 KiB samples: 64 a shard)
    s = replace(Settings(), replicas=1, samples_per_node=max(256, 4 * a.batch))
    work = tempfile.mkdtemp(prefix="emu-spanning-")
    shm = "/dev/shm/stagefs-emu-spanning"
    shutil.rmtree(shm, ignore_errors=True)
    pack, paths, _ = make_dataset(origin, s, n)
    with open(os.path.join(work, "digests.json"), "w") as f:
        json.dump(paths, f)
    with open(os.path.join(work, "hosts"), "w") as f:
        f.write("".join(f"{node_ip(k)}:{PORT}\n" for k in range(n)))
    subprocess.run([sys.executable, "-m", "stagefs.cli", "serve", "--new-token",
                    os.path.join(work, "token")], check=True, capture_output=True, timeout=60)
    try:
        with Net(n, a.rate_mbit) as net:
            for dev, where in (("se0h", []), ("se0p", ["ip", "netns", "exec", net.ns[0]])):
                sh(*where, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                   f"{reader_rate}mbit", "burst", "256kb", "latency", "50ms")
            daemons = [net.run(k, [sys.executable, "-m", "stagefs.cli", "serve", pack,
                                   "--hosts", os.path.join(work, "hosts"), "--rank", str(k),
                                   "--token-file", os.path.join(work, "token"),
                                   "--replicas", "1", "--tier", f"{shm}/n{k}/mem",
                                   "--runtime", f"{shm}/rt{k}", "--wait", "--progress", "0"],
                               os.path.join(work, f"daemon{k}.log")) for k in range(n)]
            deadline = time.monotonic() + 600
            while not all(os.path.exists(f"{shm}/rt{k}/cluster.json") for k in range(n)):
                if any(d.poll() is not None for d in daemons) or time.monotonic() > deadline:
                    raise SystemExit(f"the daemons did not stage; see {work}/daemon*.log")
                time.sleep(0.05)
            rawp = subprocess.Popen(["ip", "netns", "exec", net.ns[1], sys.executable, "-c",
                                     RAW_SERVER, pack, node_ip(1)], stdout=subprocess.PIPE,
                                    start_new_session=True)
            assert rawp.stdout is not None
            raw_port = rawp.stdout.readline().decode().strip()
            p = subprocess.run(["ip", "netns", "exec", net.ns[0], sys.executable, "-c", READER,
                                work, pack, f"{shm}/rt0", str(n), str(a.batch), str(a.runs),
                                node_ip(1), str(PORT), raw_port],
                               capture_output=True, text=True, timeout=600)
            rawp.kill()
            if p.returncode:
                raise SystemExit(f"the reader failed:\n{p.stderr[-3000:]}")
            res = json.loads(p.stdout)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    res.update(rate_mbit=a.rate_mbit, reader_rate_mbit=reader_rate, runs=a.runs,
               ratio=res["spanning_s"] / res["slowest_alone_s"], load_average=os.getloadavg())
    wire = res["part_bytes"] * 8 / (a.rate_mbit * 1e6)
    print(table(["peers", "part (bytes)", "a part on its link (s)", "slowest part alone (s)",
                 "spanning batch (s)", "ratio (1 parallel)"],
                [[str(res["peers"]), f"{res['part_bytes']:,}", f"{wire:.3f}",
                  f"{res['slowest_alone_s']:.3f}", f"{res['spanning_s']:.3f}",
                  f"{res['ratio']:.2f} ({res['peers']} serial)"]]))
    one = res["one_peer_s"]
    print(table([f"peer 1's part ({res['one_peer_bytes']:,} bytes) over its "
                 f"{a.rate_mbit:g} Mbit/s link", "s", "MB/s", "vs raw loop"],
                [[name, f"{one[k]:.4f}", f"{res['one_peer_bytes'] / one[k] / 1e6:.1f}",
                  f"{one['raw'] / one[k]:.2f}"]
                 for name, k in (("through node 0's daemon (relayed)", "relayed"),
                                 ("directly to peer 1's daemon", "direct"),
                                 ("raw socket loop", "raw"))]))
    shutil.rmtree(work, ignore_errors=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "spanning.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
