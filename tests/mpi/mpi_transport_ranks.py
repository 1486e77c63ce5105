"""One rank of the MPI transport tests: ``mpiexec -n N python mpi_transport_ranks.py WORKDIR``
(reads, refusals, conformance) or ``... WORKDIR hung`` (a peer rank hangs).

Each rank places the shards ``s % N == rank`` in a tier of its own (the daemon's tier
layer), serves them through the MPI transport, and reads every file of the other ranks'
shards through it with a Store (which verifies each file's checksum); the origin is not a
holder, so a byte not given by MPI fails the read. Then it asks the next rank for bad
ranges, unknown shards and shards that rank does not hold: each is refused. Rank 0 then runs
the holder conformance checks (stagefs.testing.holders) on rank 1 as a holder, once rank 1
holds every shard but shard 0. Each rank writes what it saw to ``WORKDIR/mpi{rank}.json``.

``hung``: rank 0 stops rank 1 (SIGSTOP: alive, never answering) and reads rank 1's shards
through it (PeerUnavailable within the deadline, the peer then suspect) and through a Store
whose next holder is the origin (every file right); then lets it go on (SIGCONT), pings it
(answering again, no longer suspect) and reads every file through MPI again.

``late``: rank 0 stops rank 1 and gives up on its replies (a read of all its shards, a
rendezvous-sized reply, and a ping); rank 1 goes on, answers them late, and its clock is
moved past the replies' send timeout. Until what MPI held for those replies is let go on
both ranks (or a bounded number of rounds passes), each rank reports what it still holds;
then each reads every file of the other's shards through MPI.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from typing import Any

from xxhash import xxh3_64_hexdigest

from stagefs.cluster.mpi_transport import MpiLimits, MpiTransport, mpi_library
from stagefs.cluster.transport import peer_sources
from stagefs.config import TierSpec
from stagefs.format import KIND_FILE, MANIFEST_NAME, Manifest
from stagefs.net.client import PeerUnavailable
from stagefs.runtime import Runtime
from stagefs.store import Store
from stagefs.testing.holders import CHECKS, HolderCase, check_after_fork, run_checks
from stagefs.tiers.chain import TierChain
from stagefs.tiers.origin import PackOrigin


def tier_chain(work: str, pack: str, m: Manifest, rank: int) -> TierChain:
    rt = os.path.join(work, f"rt{rank}")
    os.makedirs(rt, mode=0o700, exist_ok=True)
    return TierChain(m, PackOrigin(pack, m), [TierSpec(os.path.join(work, f"node{rank}"), None)],
                     Runtime(rt).open(), origin_path=pack)


def staged_rank(work: str) -> tuple[Any, Any, int, int, str, dict[str, str], Manifest,
                                    TierChain]:
    """This rank's start: MPI, the world, its rank and their number, the pack, the files'
    expected digests, the manifest, and a tier chain holding the shards ``s % size ==
    rank``."""
    mpi = mpi_library("the MPI transport test")
    comm = mpi.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    pack = os.path.join(work, "pack")
    with open(os.path.join(work, "expected.json")) as f:
        expected: dict[str, str] = json.load(f)
    m = Manifest(os.path.join(pack, MANIFEST_NAME))
    chain = tier_chain(work, pack, m, rank)
    for s in range(rank, len(m.shards), size):
        assert chain.place(s) == "placed", s
    return mpi, comm, rank, size, pack, expected, m, chain


class PeerCase(HolderCase):
    """Rank ``peer`` (holding every shard but ``absent``) as a holder, through MPI."""

    def __init__(self, source: Any, m: Manifest, origin: PackOrigin, paths: dict[int, str],
                 absent: int) -> None:
        self.name = f"MPI {source.name}"
        self.manifest, self.holder, self.absent = m, source, absent
        self._origin, self._paths = origin, paths
        self._changed: list[tuple[str, int, int]] = []

    def shard_bytes(self, shard: int) -> bytes:
        return self._origin.pread(shard, 0, self.manifest.shards[shard].size)

    def corrupt(self, shard: int, offset: int, value: int) -> None:
        path = self._paths[shard]
        with open(path, "r+b") as f:
            f.seek(offset)
            self._changed.append((path, offset, f.read(1)[0]))
            f.seek(offset)
            f.write(bytes([value]))

    def close(self) -> None:  # the peer's copy as it was, for the next check
        for path, offset, old in reversed(self._changed):
            with open(path, "r+b") as f:
                f.seek(offset)
                f.write(bytes([old]))


def main(work: str) -> dict[str, Any]:
    mpi, comm, rank, size, pack, expected, m, chain = staged_rank(work)
    nshards = len(m.shards)
    transport = MpiTransport(comm, m, chain.locate).start()
    sources = peer_sources(transport, dict.fromkeys(n for n in range(size) if n != rank))
    comm.Barrier()

    # every file of the other ranks' shards, through MPI, verified by the Store
    def holders(shard: int) -> tuple[Any, ...]:
        return (sources[shard % size],) if shard % size != rank else ()

    store = Store(pack, manifest=m, sources=holders)
    paths = [m.path_of(e).decode() for e in m.files()
             if m.kind[e] == KIND_FILE and int(m.shard[e]) % size != rank]
    bad = sum(xxh3_64_hexdigest(store.read(p)) != expected[p] for p in paths[::2])
    for i in range(0, len(paths), 16):
        batch = paths[i : i + 16]
        bad += sum(xxh3_64_hexdigest(d) != expected[p]
                   for p, d in zip(batch, store.read_many(batch), strict=True))
    got = {n: p.stats.as_dict() for n, p in transport.peers.items()}

    # refused: bad ranges, unknown shards, a shard the peer does not hold
    nxt = (rank + 1) % size
    src = sources[nxt]
    own = next(s for s in range(nxt, nshards, size))
    other = next(s for s in range(nshards) if s % size != nxt)
    n = m.shards[own].size
    refused = 0
    for shard, off, length in [(own, n - 2, 3), (own, n, 1), (own, -1, 2), (own, 0, -1),
                               (nshards, 0, 1), (-1, 0, 1), (2**40, 0, 1), (other, 0, 8)]:
        try:
            src.pread(shard, off, length)
        except PeerUnavailable:
            refused += 1
    many = src.pread_many([(own, 0, 16), (nshards, 0, 1), (own, n - 1, 2), (other, 0, 8),
                           (own, n - 16, 16)])
    origin = PackOrigin(pack, m)
    many_ok = (many[0] == origin.pread(own, 0, 16) and many[1:4] == [None, None, None]
               and many[4] == origin.pread(own, n - 16, 16))
    suspect_after_refusals = src.is_down()
    comm.Barrier()

    # the holder conformance checks, rank 0 on rank 1 (which now holds all but shard 0)
    if rank == 1:
        for s in range(1, nshards):
            assert chain.place(s) in ("placed", "held"), s
    tier_paths = comm.bcast({s: chain.locate(s) for s in range(nshards)} if rank == 1
                            else None, root=1)
    comm.Barrier()
    conformance = None
    if rank == 0:
        # not after_fork: MPI does not carry into a forked child (the daemon never forks;
        # DataLoader workers read peers over TCP)
        checks = [c for c in CHECKS if c is not check_after_fork]
        run_checks(lambda: PeerCase(sources[1], m, origin, tier_paths, 0), checks)
        conformance = [c.__name__ for c in checks]
    comm.Barrier()
    transport.close()
    chain.close()
    return {"rank": rank, "files": len(paths), "bad": bad, "peers": got,
            "store_checksum_failures": store.stats.checksum_failures,
            "store_unavailable": store.stats.unavailable, "refused": refused,
            "many_ok": many_ok, "suspect_after_refusals": suspect_after_refusals,
            "conformance": conformance, "served": transport.stats.as_dict(),
            "threads": mpi.Query_thread() == mpi.THREAD_MULTIPLE}


def hung(work: str) -> dict[str, Any]:
    _mpi, comm, rank, size, pack, expected, m, chain = staged_rank(work)
    transport = MpiTransport(comm, m, chain.locate,
                             limits=MpiLimits(timeout=2.0, probe_timeout=2.0)).start()
    sources = peer_sources(transport, dict.fromkeys(n for n in range(size) if n != rank))
    pids = comm.allgather(os.getpid())
    comm.Barrier()
    out: dict[str, Any] = {"rank": rank}
    if rank == 0:
        src, peer = sources[1], transport.peers[1]
        paths = [m.path_of(e).decode() for e in m.files()
                 if m.kind[e] == KIND_FILE and int(m.shard[e]) % size == 1]
        os.kill(pids[1], signal.SIGSTOP)  # rank 1 hangs: alive, never answering
        try:
            try:
                src.pread(1, 0, 64)
                out["first"] = "bytes"
            except PeerUnavailable as exc:
                out["first"] = str(exc)
            out["suspect"] = src.is_down()
            origin = PackOrigin(pack, m)
            store = Store(pack, manifest=m, origin=origin,
                          sources=lambda s: (sources[s % size], origin) if s % size
                          else (origin,))
            out["bad_while_hung"] = sum(
                xxh3_64_hexdigest(d) != expected[p]
                for p, d in zip(paths, store.read_many(paths), strict=True))
            out["origin_bytes"] = origin.stats.bytes_read
        finally:
            os.kill(pids[1], signal.SIGCONT)
        out["probe"] = peer.probe()  # it answers again: no longer suspect
        out["suspect_after"] = src.is_down()
        before = peer.stats.bytes
        back = Store(pack, manifest=m, sources=lambda s: (sources[s % size],))
        out["bad_after"] = sum(xxh3_64_hexdigest(back.read(p)) != expected[p] for p in paths)
        out["mpi_bytes_after"] = peer.stats.bytes - before
        out["failures"] = peer.stats.failures
    comm.Barrier()
    transport.close()
    chain.close()
    return out


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def late(work: str) -> dict[str, Any]:
    mpi, comm, rank, size, pack, expected, m, chain = staged_rank(work)
    skew = [0.0]  # rank 1's clock is moved on, past its replies' send timeout
    limits = MpiLimits(timeout=1.0, probe_timeout=1.0, send_timeout=30.0)
    transport = MpiTransport(comm, m, chain.locate, limits=limits,
                             clock=lambda: time.monotonic() + skew[0]).start()
    sources = peer_sources(transport, dict.fromkeys(n for n in range(size) if n != rank))
    pids = comm.allgather(os.getpid())
    comm.Barrier()
    out: dict[str, Any] = {"rank": rank}
    if rank == 0:
        peer = transport.peers[1]
        ranges = [(s, 0, m.shards[s].size) for s in range(1, len(m.shards), size)]
        out["reply_bytes"] = sum(n for _, _, n in ranges)
        os.kill(pids[1], signal.SIGSTOP)
        try:
            while not _stopped(pids[1]):
                time.sleep(0.01)
            try:
                peer.read(ranges)
                out["first"] = "bytes"
            except PeerUnavailable as exc:
                out["first"] = str(exc)
            out["ping_while_stopped"] = peer.probe()
        finally:
            os.kill(pids[1], signal.SIGCONT)
        while not peer.probe():  # answering again (it answered the read and ping before)
            pass
    comm.Barrier()
    held: list[Any] = []
    for _ in range(200):  # bounded: before, what was given up on was held for ever
        if rank == 1:
            skew[0] += limits.send_timeout + 1
        unexpected = transport.comm.Iprobe(mpi.ANY_SOURCE, mpi.ANY_TAG)
        held = comm.allgather([len(transport.abandoned), len(transport._sending),
                               bool(unexpected)])
        if all(h == [0, 0, False] for h in held):
            break
        time.sleep(0.05)
    out["held"] = held
    out["status"] = transport.status()
    store = Store(pack, manifest=m, sources=lambda s: (sources[s % size],)
                  if s % size != rank else ())
    paths = [m.path_of(e).decode() for e in m.files()
             if m.kind[e] == KIND_FILE and int(m.shard[e]) % size != rank]
    out["files_after"] = len(paths)
    out["bad_after"] = sum(xxh3_64_hexdigest(d) != expected[p]
                           for p, d in zip(paths, store.read_many(paths), strict=True))
    comm.Barrier()
    transport.close()
    chain.close()
    return out


if __name__ == "__main__":
    workdir = sys.argv[1]
    modes = {"hung": hung, "late": late}
    try:
        out = modes[sys.argv[2]](workdir) if sys.argv[2:] else main(workdir)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
    with open(os.path.join(workdir, f"mpi{out['rank']}.json"), "w") as f:
        json.dump(out, f)
