"""Cluster benchmark: peer reads against a raw socket loop, and staging 4 nodes from the PFS.

1. Peer reads. A real daemon (``stagefs serve``, its own process) holds an ImageNet-like
   pack in its memory tier; this process reads every sample from it with batched requests
   (``PeerClient.read``, 64 ranges per request, checksums verified as the Store does) and,
   alternating, through a raw socket loop moving the same byte counts from another process
   (request = the list of ranges, reply = those bytes, sliced out of the shards held in
   the raw server's memory and sent with scatter sendmsg, no copy; no framing, no authentication, no
   checksum): the limit. (It moves the real shard bytes: a buffer of zeros would be read
   from one cached zero page and flatter the limit.) Also the latency of one small sample (4 KiB and 110 KB) both ways.
2. Staging with 4 nodes (``mpiexec -n 4 stagefs serve``, each rank its own node directory)
   from the test PFS at /tmp/pfs: origin bytes and time, against 4 processes each copying
   the whole pack from the PFS at the same time (what a job without stagefs does). The page
   cache is dropped before each run (root), so the PFS is read, not memory.

    python benchmarks/bench_cluster.py --files 2000 --runs 5 --out benchmarks/results

Figures are medians of --runs, printed as a table and saved to cluster.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any

from xxhash import xxh3_64_intdigest

import stagefs
from stagefs._table import table
from stagefs.bench.datasets import imagenet_like
from stagefs.bench.runner import drop_caches
from stagefs.cluster.cmap import load_runtime
from stagefs.format import Manifest
from stagefs.net.client import PeerClient

BATCH = 64

RAW_SERVER = r"""
import os, socket, struct, sys
pack = sys.argv[1]
names = sorted(f for f in os.listdir(pack) if f.endswith(".sfs"))
shards = [memoryview(open(os.path.join(pack, f), "rb").read()) for f in names]  # the real bytes
s = socket.socket(); s.bind((sys.argv[2] if len(sys.argv) > 2 else "127.0.0.1", 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rng = struct.Struct("!IQI")
while True:
    h = c.recv(4, socket.MSG_WAITALL)
    if len(h) < 4:
        break
    n = struct.unpack("!I", h)[0]
    body = c.recv(n * rng.size, socket.MSG_WAITALL)
    views = [shards[sh][o : o + k] for sh, o, k in rng.iter_unpack(body)]
    while views:  # scatter send straight from the shard bytes, no copy in user space
        sent = c.sendmsg(views[:512])
        while views and sent >= len(views[0]):
            sent -= len(views.pop(0))
        if sent:
            views[0] = views[0][sent:]
"""


def make_pack(root: str, files: int, shard_size: str) -> tuple[str, int]:
    src, pack = os.path.join(root, "src"), os.path.join(root, "pack")
    if not os.path.exists(os.path.join(pack, "manifest.sfm")):
        shutil.rmtree(root, ignore_errors=True)
        imagenet_like(src, files=files, classes=max(1, files // 100), progress=False)
        stagefs.pack(src, pack, shard_size=shard_size, jobs=2)
        shutil.rmtree(src)
    size = sum(os.path.getsize(os.path.join(pack, f)) for f in os.listdir(pack)
               if f.endswith(".sfs"))
    return pack, size


def wait_staged(runtimes: list[str], proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ok = 0
        for rt in runtimes:
            try:
                with open(os.path.join(rt, "cluster.json")) as f:
                    ok += bool(json.load(f)["staged"])
            except (OSError, ValueError):
                pass
        if ok == len(runtimes):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"daemons exited with {proc.returncode}")
        time.sleep(0.1)
    raise RuntimeError("staging did not finish in time")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


# -- 1. peer reads ------------------------------------------------------------------------

def peer_reads(work: str, files: int, runs: int) -> dict[str, Any]:
    pack, size = make_pack(os.path.join(work, "peer"), files, "64MiB")
    rt = os.path.join(work, "peer-rt")
    tier = os.path.join("/dev/shm", f"stagefs-bench-cluster-{os.getpid()}")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "stagefs.cli", "serve", pack, "--tier", tier + ":2GiB",
         "--runtime", rt, "--bind", "127.0.0.1", "--progress", "0", "--no-mpi"], start_new_session=True, stderr=subprocess.DEVNULL)
    raw = subprocess.Popen([sys.executable, "-c", RAW_SERVER, pack], stdout=subprocess.PIPE,
                           start_new_session=True)
    try:
        wait_staged([rt], daemon, 300)
        cmap, token = load_runtime(rt)
        m = Manifest(os.path.join(pack, "manifest.sfm"))
        ents = list(m.files())
        ranges = [(m.shard[e], m.offset[e], m.stored[e]) for e in ents]
        sums = [m.checksum[e] for e in ents]
        nbytes = sum(r[2] for r in ranges)
        host, port = cmap.nodes[0]
        client = PeerClient(host, port, token, pack_id=m.pack_id)
        assert raw.stdout is not None
        rport = int(raw.stdout.readline())
        rs = socket.create_connection(("127.0.0.1", rport))
        rs.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rbuf = bytearray(256 * 2**20)
        rview = memoryview(rbuf)

        def raw_get(batch: list[tuple[int, int, int]]) -> None:
            rs.sendall(len(batch).to_bytes(4, "big")
                       + b"".join(struct.pack("!IQI", *r) for r in batch))
            n = sum(r[2] for r in batch)
            got = 0
            while got < n:
                got += rs.recv_into(rview[got:n], n - got)

        def peer_epoch() -> None:
            for i in range(0, len(ranges), BATCH):
                out = client.read(ranges[i : i + BATCH])
                for d, c in zip(out, sums[i : i + BATCH], strict=True):
                    if d is None or xxh3_64_intdigest(d) != c:
                        raise RuntimeError("peer read returned wrong bytes")

        def peer_epoch_unverified() -> None:
            for i in range(0, len(ranges), BATCH):
                client.read(ranges[i : i + BATCH])

        def raw_epoch() -> None:
            for i in range(0, len(ranges), BATCH):
                raw_get(ranges[i : i + BATCH])

        peer_t: list[float] = []
        raw_t: list[float] = []
        bare_t: list[float] = []
        peer_epoch()
        raw_epoch()  # warm both
        for _ in range(runs):
            for fn, acc in ((peer_epoch, peer_t), (raw_epoch, raw_t),
                            (peer_epoch_unverified, bare_t)):
                t0 = time.perf_counter()
                fn()
                acc.append(time.perf_counter() - t0)
        lat: dict[str, dict[str, float]] = {}
        small = next(r for r in ranges if r[2] >= 4096)
        mean = min(ranges, key=lambda r: abs(r[2] - 110_000))
        for label, (s, o, _), n in (("4 KiB", small, 4096), ("110 KB", mean, mean[2])):
            pl, rl = [], []
            for _ in range(max(200, 400 * runs // 5)):
                t0 = time.perf_counter()
                client.read([(s, o, n)])
                pl.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                raw_get([(s, o, n)])
                rl.append(time.perf_counter() - t0)
            lat[label] = {"peer_us": statistics.median(pl) * 1e6,
                          "raw_us": statistics.median(rl) * 1e6}
        rs.close()
        client.close()
        m.close()
    finally:
        stop(daemon)
        stop(raw)
        shutil.rmtree(tier, ignore_errors=True)
    pt, rt_, bt = (statistics.median(peer_t), statistics.median(raw_t),
                   statistics.median(bare_t))
    return {"samples": len(ranges), "bytes": nbytes, "batch": BATCH, "pack_bytes": size,
            "peer_s": pt, "raw_s": rt_, "peer_unverified_s": bt,
            "peer_GBps": nbytes / pt / 1e9, "raw_GBps": nbytes / rt_ / 1e9,
            "peer_unverified_GBps": nbytes / bt / 1e9, "ratio": rt_ / pt,
            "ratio_unverified": rt_ / bt, "latency": lat,
            "peer_samples_per_s": len(ranges) / pt,
            "ratios_per_run": [r / p for r, p in zip(raw_t, peer_t, strict=True)],
            "load_average": os.getloadavg()}


# -- 2. staging 4 nodes from the PFS ---------------------------------------------------------

def staging(work: str, pfs: str, files: int, runs: int, nodes: int) -> dict[str, Any]:
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        raise SystemExit("mpiexec not found: pip install 'stagefs[mpi]'")
    pack, size = make_pack(os.path.join(pfs, "cluster-bench"), files, "16MiB")
    local = os.path.join("/dev/shm", f"stagefs-bench-stage-{os.getpid()}")
    res: dict[str, list[float]] = {"stagefs_s": [], "stagefs_origin": [], "copy_s": [],
                                   "copy_origin": [], "stagefs_k2_s": [],
                                   "stagefs_k2_origin": []}
    dropped = False
    for _ in range(runs):
        for variant in ("stagefs", "copy", "stagefs_k2"):
            shutil.rmtree(local, ignore_errors=True)
            os.makedirs(local)
            dropped = drop_caches()
            if variant == "copy":
                t0 = time.perf_counter()
                procs = [subprocess.Popen(["cp", "-r", pack, os.path.join(local, f"n{r}")])
                         for r in range(nodes)]
                for p in procs:
                    p.wait(600)
                res["copy_s"].append(time.perf_counter() - t0)
                res["copy_origin"].append(float(nodes * size))
                continue
            rts = [os.path.join(local, f"rt{r}") for r in range(nodes)]
            extra = ["--replicas", "2"] if variant == "stagefs_k2" else []
            t0 = time.perf_counter()
            d = subprocess.Popen(
                [mpiexec, "-n", str(nodes), sys.executable, "-m", "stagefs.cli", "serve", pack,
                 "--tier", os.path.join(local, "node{rank}") + ":4GiB", "--runtime",
                 os.path.join(local, "rt{rank}"), "--bind", "127.0.0.1", "--progress", "0",
                 *extra], start_new_session=True, stderr=subprocess.DEVNULL)
            try:
                wait_staged(rts, d, 600)
                wall = time.perf_counter() - t0
                from stagefs.cluster.status import cluster_status

                _, st = cluster_status(rts[0])
                ok = [s for s in st if s]
                origin = sum(s["staging"]["origin_bytes"] for s in ok)
                took = (max(s["staging"]["finished"] for s in ok)
                        - min(s["staging"]["started"] for s in ok))
            finally:
                stop(d)
            res[f"{variant}_s"].append(took)
            res[f"{variant}_origin"].append(float(origin))
            res.setdefault(f"{variant}_wall_s", []).append(wall)
    shutil.rmtree(local, ignore_errors=True)
    out: dict[str, Any] = {k: statistics.median(v) for k, v in res.items()}
    out.update(nodes=nodes, dataset_bytes=size, files=files, caches_dropped=dropped,
               pfs=pfs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--stage-files", type=int, default=1500)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--pfs", default="/tmp/pfs/cluster")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--skip-staging", action="store_true")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="stagefs-bench-cluster-", dir="/dev/shm")
    result: dict[str, Any] = {"command": " ".join(sys.argv), "runs": a.runs}
    try:
        pr = peer_reads(work, a.files, a.runs)
        result["peer_reads"] = pr
        print(table(["peer reads (batched, verified)", "GB/s", "samples/s", "vs raw socket"], [
            ["stagefs PeerClient, 64 ranges/request", f"{pr['peer_GBps']:.2f}",
             f"{pr['peer_samples_per_s']:,.0f}", f"{pr['ratio']:.0%}"],
            ["stagefs PeerClient, same, checksums not verified",
             f"{pr['peer_unverified_GBps']:.2f}", f"{pr['samples'] / pr['peer_unverified_s']:,.0f}",
             f"{pr['ratio_unverified']:.0%}"],
            ["raw socket loop, same bytes", f"{pr['raw_GBps']:.2f}",
             f"{pr['samples'] / pr['raw_s']:,.0f}", "100%"]]))
        print()
        print(table(["one sample", "stagefs µs", "raw socket µs"],
                    [[k, f"{v['peer_us']:.0f}", f"{v['raw_us']:.0f}"]
                     for k, v in pr["latency"].items()]))
        if not a.skip_staging:
            if not os.path.ismount(os.path.dirname(a.pfs.rstrip("/"))) and not \
                    os.path.ismount(a.pfs):
                print(f"\n(staging skipped: {a.pfs} is not on a mounted PFS)")
            else:
                st = staging(work, a.pfs, a.stage_files, a.runs, a.nodes)
                result["staging"] = st
                d = st["dataset_bytes"]
                print()
                print(table([f"staging {a.nodes} nodes from the PFS", "time s",
                             "origin bytes", "x dataset"], [
                    ["stagefs serve (K=1)", f"{st['stagefs_s']:.2f}",
                     f"{st['stagefs_origin']:,.0f}", f"{st['stagefs_origin'] / d:.2f}"],
                    ["stagefs serve (K=2, forwarded)", f"{st['stagefs_k2_s']:.2f}",
                     f"{st['stagefs_k2_origin']:,.0f}", f"{st['stagefs_k2_origin'] / d:.2f}"],
                    [f"{a.nodes} x cp -r of the whole pack", f"{st['copy_s']:.2f}",
                     f"{st['copy_origin']:,.0f}", f"{st['copy_origin'] / d:.2f}"]]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "cluster.json"), "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    print(f"\nsaved {os.path.join(a.out, 'cluster.json')}")


if __name__ == "__main__":
    main()
