"""Partial caching of small datasets: how close a tier holding a share of a dataset of a few
MB to a few hundred MB comes to it, and what later epochs read from the origin against D - C.

For each dataset (``--datasets``: MB of incompressible files of ``--file-kb`` each, packed
with the default shard size) and each share of it given to one memory tier (/dev/shm), a
child process reads three epochs with ``read_many`` (64 a call) in a shuffled order and
reports the origin bytes of epochs 2 and 3 (the Store's counters) against D - C, and the
bytes the tier holds against its capacity. ``--src DIR`` runs the children on another source
tree (the code before a change, for the same table). No timing: the figures are bytes.

    python3 benchmarks/bench_small_partial.py
    python3 benchmarks/bench_small_partial.py --src /tmp/before/src --out before.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from stagefs._table import table

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

_CHILD = r"""
import json, os, random, shutil, sys
import stagefs
pack, tier, cap = sys.argv[1], sys.argv[2], int(sys.argv[3])
shutil.rmtree(tier, ignore_errors=True)
with stagefs.open(pack, tiers=[f"{tier}:{cap}"]) as fs:
    m = fs.manifest
    d = int(sum(int(m.stored[e]) for e in range(len(m)) if m.kind[e] == 0))
    names = sorted(os.path.join(r, f) for r, _, fl in fs.walk("") for f in fl)
    rnd = random.Random(1)
    origin = []
    for _ in range(3):
        rnd.shuffle(names)
        before = fs.origin.stats.bytes_read
        for i in range(0, len(names), 64):
            fs.read_many(names[i:i + 64])
        fs.chain.wait_idle(60)
        origin.append(fs.origin.stats.bytes_read - before)
    used = fs.chain.tiers[0].used_bytes()
shutil.rmtree(tier, ignore_errors=True)
print(json.dumps({"d": d, "origin": origin, "used": used}))
"""


def _dataset(root: str, mb: float, kb: int) -> str:
    """A pack of ``mb`` MB of random files of ``kb`` KB under ``root`` (made once)."""
    name = f"d{mb:g}mb-{kb}kb"
    pack = os.path.join(root, name + ".pack")
    if not os.path.exists(os.path.join(pack, "manifest.sfm")):
        import stagefs

        raw = os.path.join(root, name)
        shutil.rmtree(raw, ignore_errors=True)
        for i in range(int(mb * 1e6 // (kb * 1000))):
            sub = os.path.join(raw, f"c{i % 10}")
            os.makedirs(sub, exist_ok=True)
            with open(os.path.join(sub, f"f{i:06d}.bin"), "wb") as f:
                f.write(os.urandom(kb * 1000))
        stagefs.pack(raw, pack, progress=False, overwrite=True)
        shutil.rmtree(raw)
    return pack


def _stored(pack: str) -> int:
    """D: the stored bytes of the pack's files."""
    import stagefs

    with stagefs.open(pack) as fs:
        m = fs.manifest
        return int(sum(int(m.stored[e]) for e in range(len(m)) if m.kind[e] == 0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", type=float, nargs="+", default=[4, 16, 64, 256],
                    help="dataset sizes in MB")
    ap.add_argument("--file-kb", type=int, nargs="+", default=[20, 110])
    ap.add_argument("--shares", type=float, nargs="+", default=[0.25, 0.5, 0.8])
    ap.add_argument("--src", help="run the children on this source tree")
    ap.add_argument("--scratch", default=os.path.join(tempfile.gettempdir(),
                                                      "stagefs-bench-small"))
    ap.add_argument("--out", default=os.path.join(RESULTS, "small-partial.json"))
    args = ap.parse_args()
    os.makedirs(args.scratch, exist_ok=True)
    env = dict(os.environ)
    if args.src:
        env["PYTHONPATH"] = os.path.abspath(args.src)
    tier = f"/dev/shm/stagefs-bench-small-{os.getpid()}"
    rows: list[dict[str, Any]] = []
    for mb in args.datasets:
        for kb in args.file_kb:
            pack = _dataset(args.scratch, mb, kb)
            for share in args.shares:
                cap = int(_stored(pack) * share)
                got = subprocess.run([sys.executable, "-c", _CHILD, pack, tier, str(cap)],
                                     env=env, capture_output=True, text=True, check=False)
                if got.returncode != 0:
                    print(got.stderr, file=sys.stderr)
                    return 1
                r = json.loads(got.stdout)
                rows.append({"mb": mb, "kb": kb, "share": share, "cap": cap, **r})
                print(f"{mb:g} MB of {kb} KB files, tier {share:.0%}: epochs 2, 3 read "
                      f"{r['origin'][1]:,} {r['origin'][2]:,} against D - C "
                      f"{r['d'] - cap:,}; the tier holds {r['used']:,} of {cap:,}",
                      flush=True)
    with open(args.out, "w") as f:
        json.dump({"src": args.src or "this tree", "rows": rows}, f, indent=1)
    print(table(["dataset", "files", "tier", "D - C (MB)", "epoch 2 (MB)", "against D - C",
                 "tier holds"],
                [[f"{r['mb']:g} MB", f"{r['kb']} KB", f"{r['share']:.0%}",
                  f"{(r['d'] - r['cap']) / 1e6:.2f}", f"{r['origin'][1] / 1e6:.2f}",
                  f"{r['origin'][1] / (r['d'] - r['cap']) - 1:+.1%}",
                  f"{r['used'] / r['cap']:.1%}"] for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
