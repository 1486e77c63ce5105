"""Peer-read transports side by side: TCP (PeerClient), MPI point-to-point (the MPI
transport), MPI one-sided (MPI_Get from windows over the mapped tier files), and a raw
socket loop moving the same bytes (the ceiling).

Two MPI ranks (this script starts ``mpiexec -n 2`` itself): rank 1 holds an ImageNet-like
pack in a memory tier (/dev/shm) and serves it four ways at once (the daemon's TCP
ShardServer, the MPI transport, one window per shard file, a raw socket server sending the
requested ranges as cheaply as the kernel allows, no framing: sendfile for a range of 64
KiB or more, scatter sendmsg from the mapped files for smaller ones); rank 0 reads every
sample in batches of --batch ranges through each, in turn, --runs times, and checks once that
MPI gives the bytes TCP gives. Then both ranks sit idle for --idle seconds and rank 1
reports the CPU its process used meanwhile (the MPI serving thread polls without spinning).

    python benchmarks/bench_transport.py --files 2000 --runs 5 --out benchmarks/results

``--without "mpi get"`` leaves a way out (MPI_Get through MPICH's active-message fallback
takes about 40 s a pass on this machine).

Figures are medians of --runs, printed as a table and saved to transport.json.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

RANGE = struct.Struct("!IQI")
SENDFILE_MIN = 64 * 2**10  # as the daemon's server (net/server.py)


def make_pack(root: str, files: int) -> str:
    import stagefs
    from stagefs.bench.datasets import imagenet_like

    src, pack = os.path.join(root, "src"), os.path.join(root, "pack")
    imagenet_like(src, files=files, classes=max(1, files // 100), progress=False)
    stagefs.pack(src, pack, shard_size="64MiB", jobs=2)
    shutil.rmtree(src)
    return pack


def raw_server(sock: socket.socket, maps: list[memoryview], fds: list[int]) -> None:
    """The ceiling: ranges sent as the kernel sends them cheapest, with no framing: a large
    range by sendfile from the tier file (page cache to socket, no copy through this
    process), small ones gathered from the mapped files into one sendmsg: what the
    daemon's server does, less everything else."""
    c, _ = sock.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out = c.fileno()

    def send_views(views: list[memoryview]) -> None:
        while views:
            sent = c.sendmsg(views[:512])
            while views and sent >= len(views[0]):
                sent -= len(views.pop(0))
            if sent:
                views[0] = views[0][sent:]

    while True:
        h = c.recv(4, socket.MSG_WAITALL)
        if len(h) < 4:
            return
        body = c.recv(struct.unpack("!I", h)[0] * RANGE.size, socket.MSG_WAITALL)
        small: list[memoryview] = []
        for s, o, n in RANGE.iter_unpack(body):
            if n < SENDFILE_MIN:
                small.append(maps[s][o : o + n])
                continue
            send_views(small)
            small = []
            while n:
                k = os.sendfile(out, fds[s], o, n)
                o, n = o + k, n - k
        send_views(small)


def idle_wait(mpi: Any, comm: Any) -> None:
    """A barrier that sleeps instead of spinning (MPICH's blocking barrier spins a core)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.005)


def rank_main(work: str, pack: str, batch: int, runs: int, idle: float,
              without: list[str]) -> None:
    from stagefs.cluster.mpi_transport import MpiTransport, mpi_library
    from stagefs.config import TierSpec
    from stagefs.format import MANIFEST_NAME, Manifest
    from stagefs.net.auth import new_token
    from stagefs.net.client import PeerClient
    from stagefs.net.server import ShardServer
    from stagefs.runtime import Runtime
    from stagefs.tiers.chain import TierChain
    from stagefs.tiers.origin import PackOrigin

    mpi = mpi_library("the transport benchmark")
    comm = mpi.COMM_WORLD
    rank = comm.Get_rank()
    m = Manifest(os.path.join(pack, MANIFEST_NAME))
    nshards = len(m.shards)
    token = comm.bcast(new_token() if rank == 0 else None, root=0)
    tier = os.path.join("/dev/shm", f"stagefs-bench-transport-{os.getppid()}")
    chain = None
    if rank == 1:
        rt = os.path.join(work, "rt")
        os.makedirs(rt, mode=0o700, exist_ok=True)
        chain = TierChain(m, PackOrigin(pack, m), [TierSpec(tier, None)], Runtime(rt).open(),
                          origin_path=pack)
        for s in range(nshards):
            chain.place(s)
        locate = chain.locate
    else:
        locate = lambda s: None  # noqa: E731 - rank 0 holds nothing
    transport = MpiTransport(comm, m, locate).start()
    wins, maps, fds = [], [], []
    if rank == 1:
        assert chain is not None
        for s in range(nshards):
            path = chain.locate(s)
            assert path is not None
            fd = os.open(path, os.O_RDONLY)
            fds.append(fd)
            mm = mmap.mmap(fd, m.shards[s].size, access=mmap.ACCESS_COPY)
            maps.append(memoryview(mm))
            wins.append(mpi.Win.Create(mm, 1, comm=comm))
        server = ShardServer(m, token, chain.locate, "127.0.0.1").start()
        raw = socket.socket()
        raw.bind(("127.0.0.1", 0))
        raw.listen(1)
        threading.Thread(target=raw_server, args=(raw, maps, fds), daemon=True).start()
        addr = (server.address, raw.getsockname())
    else:
        wins = [mpi.Win.Create(None, 1, comm=comm) for _ in range(nshards)]
        addr = None
    (tcp_addr, raw_addr) = comm.bcast(addr, root=1)
    out: dict[str, Any] = {}
    if rank == 0:
        ents = list(m.files())
        ranges = [(int(m.shard[e]), int(m.offset[e]), int(m.stored[e])) for e in ents]
        batches = [ranges[i : i + batch] for i in range(0, len(ranges), batch)]
        nbytes = sum(r[2] for r in ranges)
        client = PeerClient(*tcp_addr, token, pack_id=m.pack_id)
        peer = transport.peer(1)
        rs = socket.create_connection(raw_addr)
        rs.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rview = memoryview(bytearray(max(sum(r[2] for r in b) for b in batches)))
        gbuf = bytearray(len(rview))

        def tcp() -> None:
            for b in batches:
                client.read(b)

        def mpi_p2p() -> None:
            for b in batches:
                peer.read(b)

        def mpi_get() -> None:
            for b in batches:
                pos = 0
                by_shard: dict[int, list[tuple[int, int]]] = {}
                for s, o, n in b:
                    by_shard.setdefault(s, []).append((o, n))
                for s, rs_ in by_shard.items():
                    w = wins[s]
                    w.Lock(1, mpi.LOCK_SHARED)
                    for o, n in rs_:
                        w.Get([memoryview(gbuf)[pos : pos + n], mpi.BYTE], 1,
                              target=(o, n, mpi.BYTE))
                        pos += n
                    w.Unlock(1)
                # copied out as the other transports' bytes are
                [bytes(gbuf[:n]) for _, _, n in b]

        def raw_loop() -> None:
            for b in batches:
                rs.sendall(len(b).to_bytes(4, "big") + b"".join(RANGE.pack(*r) for r in b))
                n = sum(r[2] for r in b)
                got = 0
                while got < n:
                    got += rs.recv_into(rview[got:n], n - got)

        # the same bytes both ways, once
        if client.read(batches[0]) != peer.read(batches[0]):
            raise RuntimeError("MPI and TCP gave different bytes")
        ways = {"raw socket": raw_loop, "tcp": tcp, "mpi p2p": mpi_p2p, "mpi get": mpi_get}
        ways = {k: fn for k, fn in ways.items() if k not in without}
        times: dict[str, list[float]] = {k: [] for k in ways}
        for fn in ways.values():
            fn()  # warm
        for _ in range(runs):
            for k, fn in ways.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        lat: dict[str, float] = {}
        one = [min(ranges, key=lambda r: abs(r[2] - 110_000))]
        for k, fn in (("tcp", lambda: client.read(one)), ("mpi p2p", lambda: peer.read(one))):
            ts = []
            for _ in range(300):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            lat[k] = statistics.median(ts) * 1e6
        out = {"samples": len(ranges), "bytes": nbytes, "batch": batch, "runs": runs,
               "seconds": {k: statistics.median(v) for k, v in times.items()},
               "latency_110KB_us": lat}
        rs.close()
        client.close()
    idle_wait(mpi, comm)
    # idle: nothing asked of rank 1; how much CPU does its process burn?
    t0, c0 = time.monotonic(), time.process_time()
    polls0 = transport.stats.polls
    time.sleep(idle)
    cpu = (time.process_time() - c0) / (time.monotonic() - t0)
    idle_info = comm.gather({"cpu": cpu, "polls": transport.stats.polls - polls0}, root=0)
    idle_wait(mpi, comm)
    for w in wins:
        w.Free()
    transport.close()
    if rank == 1:
        server.close()
        for mv in maps:
            mv.release()
        for fd in fds:
            os.close(fd)
        assert chain is not None
        chain.close()
        shutil.rmtree(tier, ignore_errors=True)
    if rank == 0:
        out["idle_cpu_serving_rank"] = idle_info[1]["cpu"]
        out["idle_polls_per_s"] = idle_info[1]["polls"] / idle
        with open(os.path.join(work, "out.json"), "w") as f:
            json.dump(out, f)


def report(res: dict[str, Any]) -> str:
    from stagefs._table import table

    sec = res["seconds"]
    rows = [[k, f"{res['bytes'] / s / 1e9:.2f}", f"{sec['raw socket'] / s:.2f}",
             f"{sec['tcp'] / s:.2f}"] for k, s in sec.items()]
    lines = [f"{res['samples']} samples, {res['bytes'] / 1e6:.0f} MB, batches of "
             f"{res['batch']}, median of {res['runs']} runs",
             table(["transport", "GB/s", "x raw socket", "x tcp"], rows),
             "one 110 KB sample: " + ", ".join(
                 f"{k} {v:.0f} us" for k, v in res["latency_110KB_us"].items()),
             f"idle serving rank: {res['idle_cpu_serving_rank']:.2%} of a core, "
             f"{res['idle_polls_per_s']:.0f} MPI probes/s"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--idle", type=float, default=5.0, help="seconds of idling measured")
    ap.add_argument("--out", default=None, help="directory for transport.json")
    ap.add_argument("--without", action="append", default=[],
                    choices=("mpi p2p", "mpi get"), help="an MPI way to leave out (repeat)")
    ap.add_argument("--rank-of", default=None, help=argparse.SUPPRESS)  # set by mpiexec run
    a = ap.parse_args()
    if a.rank_of:
        work, pack = a.rank_of.split(os.pathsep)
        rank_main(work, pack, a.batch, a.runs, a.idle, a.without)
        return
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        raise SystemExit("bench_transport: needs mpiexec and mpi4py (pip install 'stagefs[mpi]')")
    with tempfile.TemporaryDirectory(prefix="stagefs-bench-transport-") as work:
        pack = make_pack(work, a.files)
        subprocess.run([mpiexec, "-n", "2", sys.executable, os.path.abspath(__file__),
                        "--batch", str(a.batch), "--runs", str(a.runs), "--idle", str(a.idle),
                        *(x for w in a.without for x in ("--without", w)),
                        "--rank-of", work + os.pathsep + pack], check=True)
        with open(os.path.join(work, "out.json")) as f:
            res = json.load(f)
    print(report(res))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "transport.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
