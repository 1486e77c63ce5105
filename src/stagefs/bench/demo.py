"""``stagefs demo``: what stagefs does, on a generated ImageNet-like dataset, in a minute."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable

import stagefs
from stagefs._table import table
from stagefs.bench.datasets import imagenet_like
from stagefs.config import format_size

__all__ = ["run_demo"]


def _timed(fn: Callable[[], int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = fn()
    return time.perf_counter() - t0, n


def run_demo(files: int = 3000, workdir: str | None = None, keep: bool = False) -> int:
    base = workdir or tempfile.mkdtemp(prefix="stagefs-demo-")
    os.makedirs(base, exist_ok=True)
    raw, packed = os.path.join(base, "raw"), os.path.join(base, "pack")
    try:
        print(f"1. generating {files:,} ImageNet-like JPEGs in {raw}")
        ds = imagenet_like(raw, files=files, classes=max(1, files // 150))
        print(f"   {ds.files:,} files, {format_size(ds.bytes)}, {ds.classes} class folders\n")

        print(f"2. packing them into {packed}")
        t_pack, _ = _timed(lambda: stagefs.pack(raw, packed, jobs=2, overwrite=True).files)
        with stagefs.open(packed) as fs:
            info = fs.info()
            print(f"   {info['shards']} shards + 1 manifest instead of {info['files']:,} files "
                  f"and {info['directories']} directories, in {t_pack:.1f} s\n")
            rows = _epochs(raw, fs)
        print("3. one epoch each, in random order, page cache warm:\n")
        print(table(["how", "samples/s", "MB/s", "vs plain files"], rows))
        print("\nstagefs verified the xxh3 checksum of every sample it returned;"
              " plain reads check nothing.")
        _tiered_epochs(packed, base)
        return 0
    finally:
        if not keep and workdir is None:
            shutil.rmtree(base, ignore_errors=True)
        elif keep:
            print(f"\nkept: {base}")


def _epochs(raw: str, fs: stagefs.Store) -> list[list[object]]:
    paths = [os.path.join(d, f) for d, _, fs_ in fs.walk("train") for f in fs_]
    random.Random(0).shuffle(paths)
    total = sum(fs.getsize(p) for p in paths)

    def plain() -> int:
        n = 0
        for p in paths:
            with open(os.path.join(raw, p), "rb") as f:
                n += len(f.read())
        return n

    def native() -> int:
        return sum(len(fs.read(p)) for p in paths)

    def batched() -> int:
        return sum(len(b) for i in range(0, len(paths), 64) for b in fs.read_many(paths[i:i + 64]))

    def stat_plain() -> int:
        for p in paths:
            os.stat(os.path.join(raw, p))
        return 0

    def stat_fs() -> int:
        for p in paths:
            fs.stat(p)
        return 0

    plain()  # warm both page caches the same way
    native()
    rows: list[list[object]] = []
    base_t = 0.0
    for name, fn in [("plain files: open + read", plain), ("stagefs: fs.read", native),
                     ("stagefs: fs.read_many (64)", batched)]:
        t = min(_timed(fn)[0] for _ in range(3))
        base_t = base_t or t
        rows.append([name, f"{len(paths) / t:,.0f}", f"{total / t / 1e6:,.0f}", f"x{base_t / t:.2f}"])
    t_os = min(_timed(stat_plain)[0] for _ in range(3))
    t_fs = min(_timed(stat_fs)[0] for _ in range(3))
    rows.append(["plain files: os.stat", f"{len(paths) / t_os:,.0f}", "-", "x1.00"])
    rows.append(["stagefs: fs.stat", f"{len(paths) / t_fs:,.0f}", "-", f"x{t_os / t_fs:.2f}"])
    return rows


PFS = "/tmp/pfs"


def _tiered_epochs(packed: str, base: str) -> None:
    """Three epochs from a PFS-like origin with tiers on /dev/shm and local disk."""
    if os.path.ismount(PFS) and os.access(PFS, os.W_OK):
        home = tempfile.mkdtemp(prefix="stagefs-demo-", dir=PFS)
        where = f"the test PFS ({home})"
    else:
        home = tempfile.mkdtemp(prefix="stagefs-demo-origin-")
        where = f"a local directory ({home}), since no test PFS is mounted at {PFS}"
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else base
    mem = tempfile.mkdtemp(prefix="stagefs-demo-tier-", dir=shm)
    runtime = tempfile.mkdtemp(prefix="stagefs-demo-rt-", dir=shm)
    try:
        origin = os.path.join(home, "pack")
        shutil.copytree(packed, origin)
        print(f"\n4. three epochs from a pack on {where},\n   tiers: half of it in memory "
              f"({mem}), the rest on local disk; placement in the background:\n")
        with stagefs.open(origin) as probe:
            total = probe.info()["shard_bytes"]
        tiers = [f"{mem}:{total // 2}", os.path.join(base, "disk-tier")]
        rows = []
        with stagefs.open(origin, tiers=tiers, runtime=runtime) as fs:
            assert fs.chain is not None
            paths = [os.path.join(d, f) for d, _, names in fs.walk() for f in names]
            for epoch in range(1, 4):
                random.Random(epoch).shuffle(paths)
                o0, hits0, miss0 = fs.origin.stats.as_dict(), fs.status()["hits"], fs.chain.misses
                t, _ = _timed(lambda: sum(len(fs.read(p)) for p in paths))
                fs.chain.wait_idle(120)
                o1, st = fs.origin.stats.as_dict(), fs.status()
                hits, misses = st["hits"] - hits0, fs.chain.misses - miss0
                rows.append([epoch, f"{t:.2f}", f"{len(paths) / t:,.0f}",
                             (o1["opens"] - o0["opens"]) + (o1["stats"] - o0["stats"]),
                             format_size(o1["bytes_read"] - o0["bytes_read"]),
                             f"{100 * hits / max(1, hits + misses):.0f}%"])
            held = " + ".join(f"{t['shards_held']} in {t['kind']}" for t in st["tiers"])
        print(table(["epoch", "s", "samples/s", "origin opens+stats", "origin bytes",
                     "tier hit rate"], rows))
        print(f"\nshards held: {held} of {st['shards']}. Epoch 1 read from the origin while "
              "the shards were copied;\nlater epochs never touched it.")
    finally:
        for d in (home, mem, runtime):
            shutil.rmtree(d, ignore_errors=True)
