"""Any program through the preload library (``stagefs run``), side by side with the native
API, FUSE and plain files, on the same staged ImageNet-like dataset.

1. Warm random reads: a small C program opens, reads and closes every file in a random
   order (the same order for all), as plain files on the local disk (ext4: the ceiling),
   under ``stagefs run`` (the preload library, raw files read from the tier in /dev/shm)
   and on a FUSE mount of the same pack and tier; the native API is ``Store.read`` of the
   same files in Python. Files/s, and the preload against the native API.
2. stat/s: the C program stats every path (``--stat``), ten passes, per process.
3. cat and md5sum over ``--gib`` of 64 MiB files: under ``stagefs run`` against the same on
   the local ext4 copy (in the page cache), each timed by bash's ``time`` around the tool
   alone, inside the run (so not the run's own start). The preload reads a tier in /dev/shm
   (the memory tier) and, like with like, a tier on the same ext4 file system as the plain
   copy; "raw tier files" is the tool over the /dev/shm tier's shard files themselves, no
   stagefs and no checksum: the most a tmpfs tier can give (tmpfs reads 4 KiB pages one by
   one, ext4's page cache large folios; on this machine tmpfs reads at about 0.6 of ext4).

Every figure is the median of --runs passes, systems alternating within each pass. Tiers are
staged (``stagefs stage``) before anything is timed.

    python benchmarks/bench_preload.py --files 10000 --runs 5 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import stagefs
from stagefs._table import table
from stagefs.bench.datasets import imagenet_like
from stagefs.posix.fuse import fuse_available

READER_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
/* reader LIST [--stat]: open/read/close (or stat) every path of LIST; prints files/s */
int main(int argc, char **argv) {
    FILE *l = fopen(argv[1], "r"); char line[4096]; char **paths = NULL; size_t n = 0, cap = 0;
    while (fgets(line, sizeof line, l)) {
        line[strcspn(line, "\n")] = 0;
        if (n == cap) { cap = cap ? cap * 2 : 1024; paths = realloc(paths, cap * sizeof *paths); }
        paths[n++] = strdup(line);
    }
    fclose(l);
    int do_stat = argc > 2; static char buf[1 << 20]; long long bytes = 0; struct stat st;
    struct timespec a, b; clock_gettime(CLOCK_MONOTONIC, &a);
    int passes = do_stat ? 10 : 1;
    for (int p = 0; p < passes; p++)
        for (size_t i = 0; i < n; i++) {
            if (do_stat) { if (stat(paths[i], &st) != 0) { perror(paths[i]); return 1; } continue; }
            int fd = open(paths[i], O_RDONLY);
            if (fd < 0) { perror(paths[i]); return 1; }
            ssize_t r; while ((r = read(fd, buf, sizeof buf)) > 0) bytes += r;
            if (r < 0) { perror(paths[i]); return 1; }
            close(fd);
        }
    clock_gettime(CLOCK_MONOTONIC, &b);
    double s = (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9;
    printf("%f %lld\n", (double)n * passes / s, bytes);
    return 0;
}
"""


def c_reader(work: str) -> str:
    src, exe = os.path.join(work, "reader.c"), os.path.join(work, "reader")
    with open(src, "w") as f:
        f.write(READER_C)
    subprocess.run(["cc", "-O2", "-o", exe, src], check=True)
    return exe


def run_reader(cmd: list[str]) -> float:
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=3600)
    return float(out.stdout.split()[0])


def tool_time(prefix: list[str], tool: str, files: list[str]) -> float:
    """Seconds of ``tool files > /dev/null`` alone, as bash's ``time`` sees it (run inside
    ``prefix``, e.g. ``stagefs run ... --``, whose own start it leaves out)."""
    script = 'TIMEFORMAT=%R; time "$@" > /dev/null'
    out = subprocess.run([*prefix, "bash", "-c", script, "bash", tool, *files], check=True,
                         capture_output=True, text=True, timeout=3600)
    return float(out.stderr.split()[-1])


def stage(pack: str, tier: str) -> None:
    subprocess.run([sys.executable, "-m", "stagefs.cli", "stage", pack, "--tier", tier,
                    "--no-progress"], check=True, capture_output=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=10000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--gib", type=float, default=1.0, help="dataset size for cat/md5sum")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="bench-preload-", dir="/tmp")
    shm = tempfile.mkdtemp(prefix="bench-preload-tier-", dir="/dev/shm")
    at = os.path.join(work, "served")  # not on disk: nothing behind it to read by mistake
    try:
        src = os.path.join(work, "src")
        imagenet_like(src, files=a.files, progress=False)
        pack = os.path.join(work, "pack")
        stagefs.pack(src, pack, progress=False)
        tier = f"{shm}/t:8GiB"
        rels = sorted(os.path.relpath(os.path.join(d, f), src)
                      for d, _, fs in os.walk(src) for f in fs)
        random.Random(0).shuffle(rels)
        lists = {}
        for name, root in (("plain", src), ("staged", at)):
            lists[name] = os.path.join(work, f"{name}.list")
            with open(lists[name], "w") as f:
                f.write("".join(os.path.join(root, r) + "\n" for r in rels))
        exe = c_reader(work)
        run = [sys.executable, "-m", "stagefs.cli", "run", "--dataset", pack, "--at", at,
               "--tier", tier, "--"]
        stage(pack, tier)
        subprocess.run([*run, exe, lists["staged"]], check=True, capture_output=True)
        store = stagefs.open(pack, tiers=[tier])
        for r in rels:  # warm
            store.read(r)

        def native() -> float:
            t = time.perf_counter()
            for r in rels:
                store.read(r)
            return len(rels) / (time.perf_counter() - t)

        mnt = os.path.join(work, "mnt")
        fuse = fuse_available() is None  # None: a mount can work here
        if fuse:
            os.makedirs(mnt)
            subprocess.run([sys.executable, "-m", "stagefs.cli", "mount", pack, mnt, "--tier",
                            tier], check=True)
            fuse_list = os.path.join(work, "fuse.list")
            with open(fuse_list, "w") as f:
                f.write("".join(os.path.join(mnt, r) + "\n" for r in rels))
            run_reader([exe, fuse_list])  # warm its page cache
        systems: dict[str, Any] = {
            "plain ext4 (C)": lambda: run_reader([exe, lists["plain"]]),
            "preload (C, stagefs run)": lambda: run_reader([*run, exe, lists["staged"]]),
            "native API (Store.read)": native,
        }
        if fuse:
            systems["FUSE (C)"] = lambda: run_reader([exe, fuse_list])
        stats = {"plain ext4 (C)": lambda: run_reader([exe, lists["plain"], "--stat"]),
                 "preload (C, stagefs run)": lambda: run_reader([*run, exe, lists["staged"],
                                                                 "--stat"])}
        reads: dict[str, list[float]] = {k: [] for k in systems}
        stat_rates: dict[str, list[float]] = {k: [] for k in stats}
        for _ in range(a.runs):
            for k, system in systems.items():
                reads[k].append(system())
            for k, system in stats.items():
                stat_rates[k].append(system())
        store.close()
        if fuse:
            subprocess.run(["fusermount3", "-u", mnt], check=False)
        # cat / md5sum over about --gib of files (the same files, whole dataset repeated)
        big = os.path.join(work, "big")
        per = max(1, int(a.gib * 2**30 // (64 * 2**20)))
        os.makedirs(os.path.join(big, "d"))
        rnd = random.Random(1)
        for i in range(per):
            with open(os.path.join(big, "d", f"f{i:03d}.bin"), "wb") as out:
                out.write(rnd.randbytes(64 * 2**20))
        bigpack = os.path.join(work, "bigpack")
        stagefs.pack(big, bigpack, progress=False, compress="none")

        def brun(tier: str) -> list[str]:
            stage(bigpack, tier)
            return [sys.executable, "-m", "stagefs.cli", "run", "--dataset", bigpack, "--at",
                    at, "--tier", tier, "--"]

        names = sorted(os.listdir(os.path.join(big, "d")))
        shm_tier, ext4_tier = f"{shm}/b", os.path.join(work, "ext4-tier")
        prefixes = {"ext4 (plain copy)": [], "preload, tier in /dev/shm": brun(shm_tier + ":8GiB"),
                    "preload, tier on ext4": brun(ext4_tier + ":8GiB")}
        files = {k: [os.path.join(big if k == "ext4 (plain copy)" else at, "d", n)
                     for n in names] for k in prefixes}
        prefixes["raw tier files (/dev/shm)"] = []
        files["raw tier files (/dev/shm)"] = sorted(
            os.path.join(d, f) for d, _, fs in os.walk(shm_tier) for f in fs if f.endswith(".sfs"))
        tools: dict[str, dict[str, list[float]]] = {"cat": {}, "md5sum": {}}
        for _ in range(a.runs):
            for tool, times in tools.items():
                for k, prefix in prefixes.items():
                    times.setdefault(k, []).append(tool_time(prefix, tool, files[k]))
        med = {k: statistics.median(v) for k, v in reads.items()}
        smed = {k: statistics.median(v) for k, v in stat_rates.items()}
        tmed = {t: {k: statistics.median(v) for k, v in times.items()}
                for t, times in tools.items()}
        gib = per * 64 / 1024
        rows = [[k, f"{v:,.0f}", f"{v / med['native API (Store.read)']:.2f}",
                 f"{v / med['plain ext4 (C)']:.2f}"] for k, v in med.items()]
        print(f"warm random reads of {len(rels)} files (median of {a.runs})")
        print(table(["system", "files/s", "vs native API", "vs plain ext4"], rows))
        print(table(["stat", "stats/s per process"], [[k, f"{v:,.0f}"] for k, v in smed.items()]))
        base = "ext4 (plain copy)"
        trows = [[t, k, f"{v:.3f}", f"{tmed[t][base] / v:.2f}"]
                 for t in tools for k, v in tmed[t].items()]
        print(f"cat / md5sum over {gib:.2f} GiB (seconds; ratio = ext4 time / this time)")
        print(table(["tool", "read from", "s", "vs ext4"], trows))
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, "preload.json"), "w") as f:
                json.dump({"files": len(rels), "runs": a.runs, "reads": reads, "stats": stat_rates,
                           "tools": tools, "gib": gib,
                           "load": os.getloadavg()}, f, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
