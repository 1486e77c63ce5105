"""``stagefs demo``: plain files against stagefs, three epochs on the same data, in a minute.

The dataset sits on an origin directory (the test PFS when it is mounted, else a temp dir, or
the user's ``--origin``), generated there unless the directory already holds files. Each
epoch reads every sample once in a new random order: plain files with open/read/close per
file, as a naive loader does, and stagefs over the same raw tree in place, with a RAM tier
on /dev/shm, in batches with ``read_many``. Each system's first epoch includes listing the
dataset (a walk for plain files, the in-place scan for stagefs).
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from tqdm import tqdm

import stagefs
from stagefs._table import table
from stagefs.bench.datasets import imagenet_like
from stagefs.bench.runner import check_out, drop_caches
from stagefs.config import format_size
from stagefs.errors import ConfigError, NotADirectoryError_, NotFoundError
from stagefs.format import MANIFEST_NAME
from stagefs.namespace import accelerator

__all__ = ["DEFAULT_SIZE", "EpochResult", "bar_chart", "run_demo"]

PFS = "/tmp/pfs"
MEAN_SAMPLE = 110_000  # bytes: ImageNet's mean JPEG, what the generator aims at
DEFAULT_SIZE = 768 * 2**20  # about a minute on 2 cores with the test PFS as the origin
BATCH = 64  # samples per read_many, a training batch


@dataclass(frozen=True, slots=True)
class EpochResult:
    """One epoch of one system: what it read, how long it took, what it cost the origin."""

    system: str
    epoch: int
    seconds: float
    samples: int
    bytes: int
    origin_bytes: int
    origin_meta: int  # opens + stats (+ directory listings) on the origin

    @property
    def rate(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0

    @property
    def mbps(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds else 0.0


def choose_origin(origin: str | None) -> tuple[str, str, bool]:
    """The origin directory, why it was chosen, and whether it is a temp dir to remove."""
    if origin is not None:
        p = os.path.abspath(origin)
        if os.path.exists(p) and not os.path.isdir(p):
            raise NotADirectoryError_(p, "--origin must be a directory (the dataset's, or an "
                                         "empty one to generate it in), not a file")
        parent = os.path.dirname(p)
        if not os.path.isdir(parent):
            raise NotFoundError(parent, f"the parent of --origin {p} does not exist: create "
                                        "it, or name a directory that does")
        return p, "given with --origin", False
    if os.path.ismount(PFS) and os.access(PFS, os.W_OK):
        return tempfile.mkdtemp(prefix="stagefs-demo-", dir=PFS), "the test PFS is mounted " \
            f"at {PFS}", True
    return tempfile.mkdtemp(prefix="stagefs-demo-origin-"), f"no test PFS is mounted at " \
        f"{PFS}: a local temp dir (pass --origin DIR to use a shared file system)", True


def _raw_files(root: str) -> tuple[list[str], int]:
    """The relative paths of the regular files under ``root``, and the directories listed."""
    paths, dirs = [], 0
    for d, _, names in os.walk(root):
        dirs += 1
        rel = os.path.relpath(d, root)
        paths += [n if rel == "." else os.path.join(rel, n) for n in names
                  if os.path.isfile(os.path.join(d, n))]
    return paths, dirs


def ensure_dataset(root: str, size: int | None) -> bool:
    """Generate an ImageNet-like dataset of about ``size`` bytes in ``root`` unless it holds
    files already; True if generated."""
    if os.path.isdir(root) and os.listdir(root):
        if os.path.exists(os.path.join(root, MANIFEST_NAME)):
            raise ConfigError(f"{root} is a pack, and the demo reads the same files as plain "
                              f"files too: unpack it first ('stagefs unpack {root} DIR') and "
                              "pass DIR, or pass an empty directory to generate a dataset in")
        return False
    want = size if size is not None else DEFAULT_SIZE
    files = max(1, want // MEAN_SAMPLE)
    try:
        os.makedirs(root, exist_ok=True)
        imagenet_like(root, files=files, classes=max(1, min(1000, files // 100)))
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise ConfigError(f"{root}: {exc.strerror} while generating the demo's dataset "
                          f"({format_size(want)}): free space there, pass a smaller --size, or "
                          "an --origin DIR on a file system with room") from None
    return True


def _bar(desc: str, total: int) -> tqdm:  # type: ignore[type-arg]
    return tqdm(total=total, desc=desc, unit="sample", leave=False, disable=None)


def _batches(paths: Sequence[str]) -> Iterator[Sequence[str]]:
    for i in range(0, len(paths), BATCH):
        yield paths[i:i + BATCH]


def _order(paths: list[str], epoch: int) -> list[str]:
    out = sorted(paths)
    random.Random(epoch).shuffle(out)
    return out


def plain_epochs(root: str, epochs: int, before: Callable[[], None]) -> list[EpochResult]:
    """Epochs of open/read/close per file; the first one lists the tree (a walk) too."""
    results: list[EpochResult] = []
    paths: list[str] = []
    dirs = 0
    for epoch in range(1, epochs + 1):
        before()
        t0 = time.perf_counter()
        if epoch == 1:
            paths, dirs = _raw_files(root)
        n = 0
        with _bar(f"epoch {epoch} plain files", len(paths)) as bar:
            for batch in _batches(_order(paths, epoch)):
                for p in batch:
                    with open(os.path.join(root, p), "rb") as f:
                        n += len(f.read())
                bar.update(len(batch))
        dt = time.perf_counter() - t0
        # every epoch opens every file; the first also lists every directory and stats
        # every name (os.walk, isfile): counted as stagefs's scan counts its own
        meta = len(paths) + (dirs + len(paths) if epoch == 1 else 0)
        results.append(EpochResult("plain files", epoch, dt, len(paths), n, n, meta))
    return results


def stagefs_epochs(root: str, tier: str, runtime: str, epochs: int,
                   before: Callable[[], None]) -> tuple[list[EpochResult], bool]:
    """Epochs of read_many over the raw tree in place with a RAM tier, and whether the C
    accelerator served its lookups; the first epoch includes opening it (the scan that
    builds its manifest)."""
    results: list[EpochResult] = []
    before()
    t_open = time.perf_counter()
    with stagefs.open(root, tiers=[tier], runtime=runtime) as fs:
        t_open = time.perf_counter() - t_open
        paths = [os.path.join(d, f) for d, _, names in fs.walk() for f in names]
        for epoch in range(1, epochs + 1):
            if epoch > 1:
                before()
            o0 = fs.origin.stats.as_dict() if epoch > 1 else dict.fromkeys(
                ("opens", "stats", "bytes_read"), 0)
            t0 = time.perf_counter()
            n = 0
            with _bar(f"epoch {epoch} stagefs", len(paths)) as bar:
                for batch in _batches(_order(paths, epoch)):
                    n += sum(len(b) for b in fs.read_many(list(batch)))
                    bar.update(len(batch))
            dt = time.perf_counter() - t0 + (t_open if epoch == 1 else 0.0)
            o1 = fs.origin.stats.as_dict()
            meta = (o1["opens"] - o0["opens"]) + (o1["stats"] - o0["stats"])
            results.append(EpochResult("stagefs", epoch, dt, len(paths), n,
                                       o1["bytes_read"] - o0["bytes_read"], meta))
        return results, fs.namespace.accelerated


def result_table(plain: Sequence[EpochResult], fast: Sequence[EpochResult]) -> str:
    """One row per epoch and system; the speed-up is stagefs's samples/s over plain files'."""
    rows: list[list[object]] = []
    for p, s in zip(plain, fast, strict=True):
        for r in (p, s):
            up = "x1.0" if r is p else f"x{s.rate / p.rate:.1f}" if p.rate else "-"
            rows.append([r.epoch, r.system, f"{r.rate:,.0f}", f"{r.mbps:,.0f}", up,
                         format_size(r.origin_bytes), f"{r.origin_meta:,}"])
    return table(["epoch", "system", "samples/s", "MB/s", "speed-up", "read from origin",
                  "origin metadata ops"], rows)


def bar_chart(plain: Sequence[EpochResult], fast: Sequence[EpochResult], width: int = 50) -> str:
    """Samples/s per epoch as bars of text blocks."""
    top = max([r.rate for r in (*plain, *fast)] + [1.0])
    lines = ["samples/s, per epoch (longer is faster)"]
    for p, s in zip(plain, fast, strict=True):
        for label, r in ((f"epoch {p.epoch}  plain files", p), ("         stagefs", s)):
            n = max(1, round(width * r.rate / top)) if r.rate else 0
            lines.append(f"{label:<20} {'█' * n} {r.rate:,.0f}")
    return "\n".join(lines)


def write_png(plain: Sequence[EpochResult], fast: Sequence[EpochResult], path: str) -> bool:
    """A grouped bar chart of samples/s and origin bytes per epoch; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    epochs = [r.epoch for r in plain]
    x, w = list(range(len(epochs))), 0.38
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((ax1, "rate", "samples/s (higher is better)"),
                           (ax2, "origin_bytes", "MB read from the origin (lower is better)")):
        for off, res, color in ((-w / 2, plain, "#999999"), (w / 2, fast, "#1f77b4")):
            vals = [getattr(r, key) / (1e6 if key == "origin_bytes" else 1) for r in res]
            ax.bar([i + off for i in x], vals, w, label=res[0].system, color=color)
        ax.set_xticks(x, [f"epoch {e}" for e in epochs])
        ax.set_title(title)
        ax.legend()
    fig.suptitle("plain files against stagefs, same data, same order")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run_demo(origin: str | None = None, size: int | None = None, out: str = "stagefs-demo",
             epochs: int = 3) -> int:
    t_start = time.perf_counter()
    # '--out=~/x' reaches us unexpanded (the shell expands '~' only at a word's start): a
    # directory named '~' in the working directory is never what was meant
    out = os.path.expanduser(out)
    origin = None if origin is None else os.path.expanduser(origin)
    if size is not None and size <= 0:
        raise ConfigError(f"--size {size}: the dataset to generate needs more than 0 bytes "
                          "(e.g. --size 300MiB)")
    made = not os.path.exists(out)
    check_out(out, "the demo's chart")  # before the run, not after it
    try:
        root, why, temp = choose_origin(origin)
    except BaseException:
        if made:  # a bad --origin leaves no empty --out behind
            with contextlib.suppress(OSError):
                os.rmdir(out)
        raise
    print(f"origin: {root} ({why})")
    generated, partial = False, not (os.path.isdir(root) and os.listdir(root))
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    scratch = tempfile.mkdtemp(prefix="stagefs-demo-", dir=shm)
    try:
        t_gen = time.perf_counter()
        generated = ensure_dataset(root, size)
        partial = False
        t_gen = time.perf_counter() - t_gen
        paths, _ = _raw_files(root)
        total = sum(os.path.getsize(os.path.join(root, p)) for p in paths)
        if generated:
            print(f"generated {len(paths):,} ImageNet-like JPEGs, {format_size(total)}, "
                  f"in {t_gen:.0f} s")
        else:
            print(f"using the {len(paths):,} files ({format_size(total)}) already there"
                  + (" (--size applies only to a generated dataset)" if size is not None else ""))
        dropped = drop_caches()
        print("page cache: dropped before each epoch" if dropped else
              "page cache: not dropped (needs root): epochs after the first may read from "
              "memory, which favours plain files")

        def before() -> None:
            if dropped:
                drop_caches()

        print(f"stagefs: the raw tree in place, a RAM tier in {scratch}, read_many "
              f"in batches of {BATCH}\n")
        plain = plain_epochs(root, epochs, before)
        fast, accelerated = stagefs_epochs(root, os.path.join(scratch, "tier"),
                                           os.path.join(scratch, "rt"), epochs, before)
        print(result_table(plain, fast))
        print("\nEach first epoch includes listing the dataset. Metadata ops: opens, stats and "
              "directory\nlistings on the origin. Plain files read every byte every epoch; "
              "stagefs reads a file\nfrom the origin until it is "
              "in the RAM tier (the scan, the samples, the copy), then never\nagain, and "
              "verifies the checksum of every sample it returns.")
        missed = fast[-1].origin_bytes if len(fast) > 1 else 0
        if missed:  # a tier too small (a container's 64 MiB /dev/shm): "never again" is not
            print(f"Here the RAM tier could not hold the dataset ({format_size(total)}; "
                  f"{format_size(shutil.disk_usage(scratch).free)} free in {scratch}): "
                  f"stagefs read {format_size(missed)} from the origin in epoch "
                  f"{fast[-1].epoch} too. Free memory there, or pass a smaller --size.")
        print()
        print(bar_chart(plain, fast))
        print("\nC accelerator: " + ("active" if accelerated else accelerator()))
        os.makedirs(out, exist_ok=True)
        png = os.path.abspath(os.path.join(out, "demo.png"))
        if write_png(plain, fast, png):
            print(f"\nchart: {png}")
        else:
            print("\nchart: no PNG (matplotlib is missing): pip install 'stagefs[plot]'")
        return 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if made:  # made for a chart that was not drawn (an error, Ctrl-C): not left empty
            with contextlib.suppress(OSError):
                os.rmdir(out)
        if temp:
            shutil.rmtree(root, ignore_errors=True)
        elif partial and os.path.isdir(root) and os.listdir(root):
            print(f"the dataset in {root} is incomplete (its generation did not finish): "
                  "remove it before running the demo on it again", file=sys.stderr)
        elif generated:
            print(f"dataset kept in {root}")
        print(f"demo took {time.perf_counter() - t_start:.0f} s")
