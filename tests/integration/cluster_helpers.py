"""Helpers of the cluster tests: a small dataset packed into many shards, MPI detection."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys

import stagefs


def free_ports(n: int) -> list[int]:
    """``n`` TCP ports free on 127.0.0.1 now (for the daemons of a test cluster)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def make_dataset(root: str, files: int = 120, seed: int = 0) -> dict[str, bytes]:
    """Write ``files`` files (mixed sizes, some compressible, a val/ subtree) under root."""
    rnd = random.Random(seed)
    content: dict[str, bytes] = {}
    for i in range(files):
        sub = "val" if i % 10 == 0 else f"train/c{i % 4}"
        rel = f"{sub}/f{i:04d}.bin" if i % 3 else f"{sub}/t{i:04d}.txt"
        n = rnd.choice([0, 1, 100, 5000, 40_000, 150_000])
        data = rnd.randbytes(n) if rel.endswith(".bin") else (b"line %d\n" % i) * (n // 8)
        os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
        with open(os.path.join(root, rel), "wb") as f:
            f.write(data)
        content[rel] = data
    return content


def make_pack(tmp: str, files: int = 120, shard_size: str = "128KiB") -> tuple[str, dict[str, bytes]]:
    src, dest = os.path.join(tmp, "src"), os.path.join(tmp, "pack")
    content = make_dataset(src, files)
    stagefs.pack(src, dest, shard_size=shard_size, jobs=1)
    return dest, content


def mpiexec() -> str | None:
    """The mpiexec of this environment if mpi4py is importable too, else None."""
    exe = shutil.which("mpiexec")
    if exe is None:
        return None
    ok = subprocess.run([sys.executable, "-c", "import mpi4py"], capture_output=True, timeout=60)
    return exe if ok.returncode == 0 else None


def write_expected(workdir: str, content: dict[str, bytes]) -> None:
    """What the readers must see: the xxh3 of every file's origin bytes."""
    import json

    from xxhash import xxh3_64_hexdigest

    with open(os.path.join(workdir, "expected.json"), "w") as f:
        json.dump({p: xxh3_64_hexdigest(d) for p, d in content.items()}, f)


def serve_args(workdir: str, pack: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "stagefs.cli", "serve", pack,
            "--tier", os.path.join(workdir, "node{rank}", "mem") + ":256MiB",
            "--runtime", os.path.join(workdir, "rt{rank}"), "--progress", "1", *extra]


def start(cmd: list[str], log: str, **kw: object) -> subprocess.Popen[bytes]:
    out = open(log, "ab")  # noqa: SIM115 - handed to the child, closed by the OS at its exit
    try:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, **kw)  # type: ignore[call-overload]
    finally:
        out.close()


def cluster_maps(workdir: str, n: int) -> list[dict[str, object] | None]:
    import json

    out: list[dict[str, object] | None] = []
    for r in range(n):
        try:
            with open(os.path.join(workdir, f"rt{r}", "cluster.json")) as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            out.append(None)
    return out


def wait_staged(workdir: str, n: int, proc: subprocess.Popen[bytes], timeout: float = 90,
                log: str | None = None) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        maps = cluster_maps(workdir, n)
        if all(m is not None and m.get("staged") for m in maps):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    text = tail(log) if log else ""
    raise AssertionError(f"cluster did not stage (exit {proc.poll()}):\n{text}")


def stop(proc: subprocess.Popen[bytes], sig: int | None = None, timeout: float = 20) -> int:
    """SIGTERM (or ``sig``) to the launched process group; SIGKILL if it does not end."""
    import signal

    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig or signal.SIGTERM)
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.wait(timeout)


def results(workdir: str, n: int | list[int]) -> list[dict[str, int]]:
    """The readers' results of ranks 0..n-1 (or of the ranks listed)."""
    import json

    out = []
    for r in range(n) if isinstance(n, int) else n:
        with open(os.path.join(workdir, f"result{r}.json")) as f:
            out.append(json.load(f))
    return out


def status_json(workdir: str, rank: int = 0) -> dict[str, object]:
    import json

    p = subprocess.run([sys.executable, "-m", "stagefs.cli", "status", "--runtime",
                        os.path.join(workdir, f"rt{rank}"), "--json"], capture_output=True,
                       timeout=60, text=True)
    assert p.returncode in (0, 1), p.stderr
    return dict(json.loads(p.stdout))


def tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def hosts_daemons(work: str, pack: str, n: int, tier: str, *extra: str, again: bool = False
                  ) -> list[subprocess.Popen[bytes]]:
    """``n`` daemons of a cluster on this machine named by a hosts file (free local ports)
    and a new token in ``work``: rank r's tier ``work``/node{r}/disk of ``tier`` (a size),
    its runtime rt{r}, its log daemon{r}.log; ``extra``: more ``serve`` options. ``again``:
    with the hosts file and token already there (the same ports and token)."""
    if not again:
        with open(os.path.join(work, "hosts"), "w") as f:
            f.write("".join(f"127.0.0.1:{p}\n" for p in free_ports(n)))
        subprocess.run([sys.executable, "-m", "stagefs.cli", "serve", "--new-token",
                        os.path.join(work, "token")], check=True, timeout=60)
    return [start([sys.executable, "-m", "stagefs.cli", "serve", pack,
                   "--tier", os.path.join(work, "node{rank}", "disk") + f":{tier}",
                   "--runtime", os.path.join(work, "rt{rank}"), "--hosts",
                   os.path.join(work, "hosts"), "--rank", str(r), "--token-file",
                   os.path.join(work, "token"), *extra],
                  os.path.join(work, f"daemon{r}.log")) for r in range(n)]


def piece_pack(work: str, files: int = 240, sizes: tuple[int, int] = (5_000, 40_000),
               shard_size: str = "3MiB", seed: int = 3) -> tuple[str, dict[str, bytes]]:
    """``work``/pack: ``files`` random files of ``sizes`` bytes (5-40 KB) under train/ in
    shards of ``shard_size`` (3 MiB: several shards, 1 MiB pieces), and the files' bytes by
    path."""
    import random

    import stagefs

    rnd = random.Random(seed)
    src = os.path.join(work, "src")
    content: dict[str, bytes] = {}
    for i in range(files):
        rel = f"train/c{i % 3}/f{i:04d}.bin"
        content[rel] = rnd.randbytes(rnd.randint(*sizes))
        os.makedirs(os.path.join(src, os.path.dirname(rel)), exist_ok=True)
        with open(os.path.join(src, rel), "wb") as f:
            f.write(content[rel])
    pack = os.path.join(work, "pack")
    stagefs.pack(src, pack, shard_size=shard_size, jobs=1)
    return pack, content


def held_in_pieces(work: str, n: int, pack: str, node: int | None = None) -> dict[str, int]:
    """The files whose bytes a node's partial copy holds (path -> size), found by their
    bytes: a piece is filled only with checked bytes, and a file not there reads as zeros.
    ``node``: that node's copies only."""
    from stagefs.format import Manifest
    from stagefs.tiers.fill import PARTIAL_SUFFIX

    m = Manifest(os.path.join(pack, "manifest.sfm"))
    try:
        held: dict[str, int] = {}
        for e in m.files():
            size = int(m.stored[e])
            if not size:
                continue
            shard, off = int(m.shard[e]), int(m.offset[e])
            name = m.shards[shard].name
            with open(os.path.join(pack, name), "rb") as f:
                f.seek(off)
                want = f.read(size)
            for r in range(n) if node is None else (node,):
                tier = os.path.join(work, f"node{r}", "disk", m.pack_id.hex())
                try:
                    with open(os.path.join(tier, name + PARTIAL_SUFFIX), "rb") as f:
                        f.seek(off)
                        got = f.read(size)
                except FileNotFoundError:
                    continue
                if got == want:
                    held[m.path_of(e).decode()] = size
        return held
    finally:
        m.close()
