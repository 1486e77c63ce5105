"""Two checkouts of stagefs side by side: warm reads, stat and verified range reads.

Each round runs one child process per checkout, alternating, on the same data (a pack
written by each checkout's own packer: the format may differ), and every figure is also
given as a ratio to a limit measured in the same child: the verified pread limit, a raw
``os.pread`` loop plus xxh3 over the same stored bytes of the same files the Store reads
(DESIGN.md, "What fast means"), and the same bytes copied out of a mapping of those files
plus xxh3 (what a reader that maps the files could reach). Warm random epochs are read
twice: from the pack's files in the page cache (no tier), and from a memory tier holding
every shard (the limits then read the tier's files). In a child, the readers take turns
over 5 passes and each figure is the median of the passes (a ratio: of the passes'
ratios); then the median of --runs rounds.

    python benchmarks/bench_regress.py --a /path/to/old/src --b src --runs 3 --no-ranges

``--rooted``: the files are named from the root ("/d/f.jpg", as ``walk("/")`` gives them)
instead of relative to it.

``--kind text``: the warm epochs read text documents that the pack stores compressed (zstd)
instead of ImageNet-like JPEGs, and the verified limit decodes them too (pread, zstd
decompress and xxh3 of the raw bytes, in one thread: what ``read`` must do per file).

Range reads: large raw files (--large-mib each) read through ``Store.open`` at random
offsets in ranges of several sizes, against pread + xxh3 of exactly the bytes asked for
(the limit of a reader that could verify any range for free) and against pread alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from typing import Any

_CHILD = r"""
import json, mmap, os, random, shutil, sys, time
import zstandard
from xxhash import xxh3_64_intdigest
import stagefs

raw, large, scratch, tag, ranges, kind, rooted = sys.argv[1:8]
def packed(src, name):
    # a pack kept from an earlier invocation is reused only if this checkout's packer, as
    # it is now, wrote it from this tree: --a and --b swapped, a checkout edited since or
    # another --files would otherwise read a pack of other code or of other data
    dest = os.path.join(scratch, name + '-' + tag)
    pkg = os.path.dirname(os.path.abspath(stagefs.__file__))
    code = sorted((os.path.relpath(os.path.join(d, f), pkg), st.st_size, st.st_mtime_ns)
                  for d, _, fl in os.walk(pkg) for f in fl if f.endswith(('.py', '.so'))
                  for st in [os.stat(os.path.join(d, f))])
    with open(os.path.join(src, '.complete')) as f:
        made_by = json.dumps([pkg, code, f.read()])
    try:
        with open(dest + '.made-by') as f:
            same = f.read() == made_by
    except OSError:
        same = False
    if not same or not os.path.exists(os.path.join(dest, 'manifest.sfm')):
        stagefs.pack(src, dest, jobs=1, overwrite=True, progress=False)
        with open(dest + '.made-by', 'w') as f:
            f.write(made_by)
    return dest

PASSES = 5

def best(fn, n=3):  # the median of n passes
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return sorted(ts)[n // 2]

def shuffled(fs):
    order = [os.path.join(d, f) for d, _, fl in fs.walk('/' if rooted == '1' else '')
             for f in fl]
    random.Random(1).shuffle(order)
    return order

def epochs(fs, shard_path):
    # read, read_many(64) and the limits over one shuffled epoch of fs, the limits reading
    # the same stored bytes from shard_path(shard) (the files the Store reads)
    order = shuffled(fs)
    m = fs.manifest
    ents = [fs.namespace.file_entry(x) for x in order]
    spans = [(int(m.shard[e]), int(m.offset[e]), int(m.stored[e])) for e in ents]
    # the same check as the Store's: decode first where the file is stored compressed
    zstd = [int(m.codec[e]) == 1 for e in ents]
    assert all(int(m.codec[e]) in (0, 1) for e in ents) and any(zstd) == (kind == 'text')
    sizes = [int(m.size[e]) for e in ents]
    unz = zstandard.ZstdDecompressor().decompress
    def raw(data, k):
        return unz(data, max_output_size=sizes[k]) if zstd[k] else data
    fds = [os.open(shard_path(s), os.O_RDONLY) for s in range(len(m.shards))]
    maps = [mmap.mmap(fd, 0, prot=mmap.PROT_READ) for fd in fds]
    def limit():  # the verified pread limit: pread (+ decode) + xxh3 of the same bytes
        for k, (s, o, n) in enumerate(spans):
            xxh3_64_intdigest(raw(os.pread(fds[s], n, o), k))
    def mapped():  # the same bytes copied out of a mapping of the same files (+ decode), + xxh3
        for k, (s, o, n) in enumerate(spans):
            xxh3_64_intdigest(raw(maps[s][o:o + n], k))
    def read():
        for x in order:
            fs.read(x)
    def read_many():
        for i in range(0, len(order), 64):
            fs.read_many(order[i:i + 64])
    fns = (limit, mapped, read, read_many)
    for fn in fns:
        fn()
    # passes alternate the readers, and each ratio is the median of the passes' ratios:
    # a neighbour's load that comes and goes weighs on both sides of a ratio alike
    t = {fn.__name__: [] for fn in fns}
    for _ in range(PASSES):
        for fn in fns:
            t0 = time.perf_counter(); fn(); t[fn.__name__].append(time.perf_counter() - t0)
    med = lambda xs: sorted(xs)[len(xs) // 2]
    ratio = lambda a, b: med([x / y for x, y in zip(t[a], t[b])])
    got = {'limit_samples_per_s': len(order) / med(t['limit']),
           'mapped_limit_samples_per_s': len(order) / med(t['mapped'])}
    for name in ('read', 'read_many'):
        got[name + '_samples_per_s'] = len(order) / med(t[name])
        got[name + '_vs_limit'] = ratio('limit', name)
        got[name + '_vs_mapped_limit'] = ratio('mapped', name)
    got['read_many_vs_read'] = ratio('read', 'read_many')
    for mm in maps:
        mm.close()
    for fd in fds:
        os.close(fd)
    return got

out = {}
p = packed(raw, 'small' if kind == 'imagenet' else 'text')
with stagefs.open(p) as fs:  # no tier: the pack's files, in the page cache
    out['warm'] = epochs(fs, lambda s: os.path.join(p, fs.manifest.shards[s].name))
    st = fs.stat
    order = shuffled(fs)
    def stat():
        for x in order:
            st(x)
    stat()
    out['warm']['stat_per_s'] = len(order) / best(stat)
# every shard copied into a memory tier first: reads served by the tier's copies
tier = os.path.join('/dev/shm', f'stagefs-bench-regress-{tag}-{os.getpid()}')
try:
    with stagefs.open(p, tiers=[tier], runtime=tier + '-rt') as fs:
        fs.chain.stage()
        assert fs.held_shards() == set(range(len(fs.manifest.shards)))
        out['tier'] = epochs(fs, fs.chain.tiers[0].path)
finally:
    shutil.rmtree(tier, ignore_errors=True)
    shutil.rmtree(tier + '-rt', ignore_errors=True)

if ranges == '1':  # range reads of large files
    p = packed(large, 'large')
    with stagefs.open(p) as fs:
        m = fs.manifest
        files = [os.path.join(d, f) for d, _, fl in fs.walk('') for f in fl if f.endswith('.bin')]
        ents = [fs.namespace.file_entry(x) for x in files]
        fds = [os.open(os.path.join(p, s.name), os.O_RDONLY) for s in m.shards]
        handles = [fs.open(x) for x in files]
        out['ranges'] = {}
        for size in (4096, 65536, 1 << 20, 8 << 20):
            rng = random.Random(size)
            picks = []
            for _ in range(max(64, (256 << 20) // size // 4)):
                i = rng.randrange(len(files))
                off = rng.randrange(0, int(m.size[ents[i]]) - size)
                picks.append((i, off))
            nbytes = size * len(picks)
            def ours():
                for i, off in picks:
                    f = handles[i]; f.seek(off); f.read(size)
            def pread_only():
                for i, off in picks:
                    e = ents[i]
                    os.pread(fds[int(m.shard[e])], size, int(m.offset[e]) + off)
            def pread_xxh3():
                for i, off in picks:
                    e = ents[i]
                    xxh3_64_intdigest(os.pread(fds[int(m.shard[e])], size, int(m.offset[e]) + off))
            for fn in (ours, pread_only, pread_xxh3):
                fn()
            t, t_p, t_px = best(ours), best(pread_only), best(pread_xxh3)
            out['ranges'][str(size)] = {'MB_per_s': nbytes / t / 1e6,
                                        'pread_MB_per_s': nbytes / t_p / 1e6,
                                        'pread_xxh3_MB_per_s': nbytes / t_px / 1e6,
                                        'vs_pread_xxh3': t_px / t, 'vs_pread': t_p / t}
        for h in handles:
            h.close()
print(json.dumps(out))
"""


def _kept(root: str, made_of: dict[str, int]) -> bool:
    """Whether ``root`` is a tree kept from an earlier run made of the same ``made_of``
    (its ``.complete`` marker says): one of another --files was reused as this one."""
    try:
        with open(os.path.join(root, ".complete")) as f:
            return bool(json.loads(f.read() or "null") == made_of)
    except (OSError, ValueError):
        return False


def _made(root: str, made_of: dict[str, int]) -> None:
    with open(os.path.join(root, ".complete"), "w") as f:
        json.dump(made_of, f)


def _large_tree(root: str, files: int, mib: int) -> str:
    made_of = {"files": files, "mib": mib}
    if not _kept(root, made_of):
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        for i in range(files):  # incompressible, and not a multiple of any piece size
            with open(os.path.join(root, f"blob-{i:03d}.bin"), "wb") as f:
                f.write(os.urandom(mib * 2**20 + 12345))
        _made(root, made_of)
    return root


def _run(src: str, raw: str, large: str, scratch: str, tag: str, ranges: bool, kind: str,
         rooted: bool) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
    env.pop("STAGEFS_TIERS", None)  # "no tier" means none, whatever the shell says
    proc = subprocess.run([sys.executable, "-c", _CHILD, raw, large, scratch, tag,
                           "1" if ranges else "0", kind, "1" if rooted else "0"], env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"the run of {src} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _median(runs: list[dict[str, Any]], *keys: str) -> float:
    vals = []
    for r in runs:
        for k in keys:
            r = r[k]
        vals.append(float(r))  # type: ignore[arg-type]
    return statistics.median(vals)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="src/ directory of the first checkout (before)")
    ap.add_argument("--b", default="src", help="src/ directory of the second checkout (after)")
    ap.add_argument("--files", type=int, default=10000)
    ap.add_argument("--kind", choices=("imagenet", "text"), default="imagenet",
                    help="the small files: ImageNet-like JPEGs (stored raw) or text documents "
                         "(stored zstd; the limits decode them too)")
    ap.add_argument("--large-files", type=int, default=6)
    ap.add_argument("--large-mib", type=int, default=48)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--no-ranges", action="store_true", help="skip the range reads")
    ap.add_argument("--rooted", action="store_true",
                    help='name the files from the root ("/d/f.jpg", as walk("/") gives them)')
    ap.add_argument("--scratch", default="/tmp/stagefs-bench-regress",
                    help="the generated trees and each checkout's packs, kept for the next "
                         "run (several GB at the defaults): remove it to free the space")
    ap.add_argument("--out", default="benchmarks/results/regress.json")
    args = ap.parse_args()

    # the data generators and the table: this script's own checkout's (--a or --b may be older)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    from stagefs._table import table
    from stagefs.bench.datasets import imagenet_like, text_like

    os.makedirs(args.scratch, exist_ok=True)
    raw = os.path.join(args.scratch, "raw" if args.kind == "imagenet" else "raw-text")
    if not _kept(raw, {"files": args.files}):
        shutil.rmtree(raw, ignore_errors=True)
        if args.kind == "imagenet":
            imagenet_like(raw, files=args.files, classes=max(1, args.files // 200))
        else:
            text_like(raw, files=args.files)
        _made(raw, {"files": args.files})
    large = ("" if args.no_ranges else  # nearly 300 MB at the defaults, for the ranges only
             _large_tree(os.path.join(args.scratch, "large"), args.large_files, args.large_mib))
    runs: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
    for _ in range(args.runs):
        for tag, src in (("a", args.a), ("b", args.b)):
            runs[tag].append(_run(src, raw, large, args.scratch, tag, not args.no_ranges,
                                  args.kind, args.rooted))
    rows = []
    for where, title in (("warm", "pack files (page cache)"), ("tier", "memory tier")):
        for label, key in (("read, samples/s", "read_samples_per_s"),
                           ("read_many(64), samples/s", "read_many_samples_per_s"),
                           ("verified pread limit, samples/s", "limit_samples_per_s"),
                           ("mapped copy + xxh3, samples/s", "mapped_limit_samples_per_s"),
                           ("read_many(64) / read", "read_many_vs_read"),
                           ("read / verified pread limit", "read_vs_limit"),
                           ("read_many(64) / verified pread limit", "read_many_vs_limit"),
                           ("read_many(64) / mapped copy + xxh3", "read_many_vs_mapped_limit")):
            a, b = _median(runs["a"], where, key), _median(runs["b"], where, key)
            rows.append([f"{title}: {label}", f"{a:,.3g}", f"{b:,.3g}", f"x{b / a:.3f}"])
    a, b = _median(runs["a"], "warm", "stat_per_s"), _median(runs["b"], "warm", "stat_per_s")
    rows.append(["stat/s", f"{a:,.3g}", f"{b:,.3g}", f"x{b / a:.3f}"])
    print(table(["figure (median)", "a (before)", "b (after)", "b / a"], rows), "\n")
    rrows = []
    if args.no_ranges:
        rrows.append(["(not measured: --no-ranges)", "", "", "", "", ""])
    for size in ("4096", "65536", str(1 << 20), str(8 << 20)) * (not args.no_ranges):
        for tag in ("a", "b"):
            got = [_median(runs[tag], "ranges", size, k) for k in
                   ("MB_per_s", "pread_xxh3_MB_per_s", "vs_pread_xxh3", "vs_pread")]
            rrows.append([f"{int(size) // 1024} KiB", tag, f"{got[0]:,.0f}", f"{got[1]:,.0f}",
                          f"{got[2]:.2f}", f"{got[3]:.2f}"])
    print(table(["range", "tree", "Store.open MB/s", "pread+xxh3 MB/s", "vs pread+xxh3",
                 "vs pread"], rrows))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"a": os.path.abspath(args.a), "b": os.path.abspath(args.b),
                   "files": args.files, "kind": args.kind, "load": os.getloadavg(), "runs": runs}, f, indent=1)
    print(f"saved {args.out}")
    kept = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.scratch)
               for f in fs)
    print(f"kept for the next run: {args.scratch} ({kept / 2**30:.1f} GiB); remove it to free "
          "the space")
    return 0


if __name__ == "__main__":
    sys.exit(main())
