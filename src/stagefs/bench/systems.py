"""The systems ``stagefs bench`` compares, one small class each behind one protocol.

A system turns the raw dataset into its own form (``convert``), opens it (``open``) and
yields ``(key, bytes)`` for one shuffled epoch (``epoch``), where ``key`` is the sample's
path relative to the raw dataset, so that every system's epochs can be checked against
the same set of samples and bytes. The runner times ``convert`` and measures each epoch in
a separate process (see measure.py); it never looks inside a system.

The protocol and the shared context are in base.py; the peers (WebDataset, MosaicML
Streaming, LitData) are in peers.py.
"""

from __future__ import annotations

import inspect
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from stagefs.bench.base import Context, System, _Base
from stagefs.bench.peers import LitDataSystem, StreamingSystem, WebDatasetSystem
from stagefs.errors import ConfigError

__all__ = ["all_systems", "serve_fuse", "start_fuse_server", "stop_fuse", "stop_fuse_server"]

BATCH = 64  # samples per read_many call / DataLoader batch


def _order(n: int, run: int, epoch: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    return np.random.default_rng(run * 1000 + epoch).permutation(n)


class _PlainReads(_Base):
    """Shuffled open() + read() of every file under a directory."""

    def _root(self, ctx: Context) -> str:
        raise NotImplementedError

    def epoch(self, ctx: Context, run: int, epoch: int) -> Iterator[tuple[str, Any]]:
        root, files = self._root(ctx), self.files
        for i in _order(len(files), run, epoch):
            rel = files[i]
            with open(os.path.join(root, rel), "rb") as f:
                yield rel, f.read()


class PlainOrigin(_PlainReads):
    name, title = "plain-origin", "plain files, origin"
    settings = "open() + read() of each file, in a random order each epoch"

    def convert(self, ctx: Context) -> str:
        return ctx.raw

    def _root(self, ctx: Context) -> str:
        return ctx.raw


class PlainLocal(_PlainReads):
    name, title = "plain-local", "plain files, local copy"
    settings = "a copy of the raw tree in node-local scratch; open() + read() in random order"
    on_origin = False

    def convert(self, ctx: Context) -> str:
        dest = ctx.scratch(self.name)
        shutil.rmtree(dest, ignore_errors=True)
        try:
            for rel in ctx.files():  # the files read (copytree failed on a FIFO, a dead link)
                to = os.path.join(dest, rel)
                os.makedirs(os.path.dirname(to), exist_ok=True)
                shutil.copyfile(os.path.join(ctx.raw, rel), to)
        except BaseException:  # a --local too small: a part copy would fill it for the
            shutil.rmtree(dest, ignore_errors=True)  # others (and this error's report)
            raise
        return dest

    def _root(self, ctx: Context) -> str:
        return ctx.scratch(self.name)


class _StagefsBase(_Base):
    """Systems reading the stagefs pack written once next to the raw data.

    ``tiered``: open it with one node-local tier (as docs/torch.md and the README show for a
    dataset on a shared file system); the tier and the runtime directory start empty in
    each run, so the first epoch stages from the origin.
    """

    pack_name = "stagefs"
    tiered = True

    def convert(self, ctx: Context) -> str:
        import stagefs

        dest = ctx.out(self.pack_name)
        stagefs.pack(ctx.raw, dest, jobs=2, overwrite=True, progress=False)
        return dest

    def tier_args(self, ctx: Context) -> tuple[list[str], str] | None:
        """(tiers, runtime dir), both emptied; None without tiers."""
        if not (self.tiered and _takes_tiers()):
            return None
        base = ctx.scratch(self.name)
        shutil.rmtree(base, ignore_errors=True)
        tier, runtime = os.path.join(base, "tier0"), os.path.join(base, "runtime")
        os.makedirs(tier)
        return [tier], runtime

    def _store(self, ctx: Context) -> Any:
        import stagefs

        pack = ctx.out(self.pack_name)
        t = self.tier_args(ctx)
        if t is None:  # no tier whatever $STAGEFS_TIERS says: a tier of the user's, never
            # emptied between runs, would serve this "no tier" system and its cold epochs
            return stagefs.open(pack, **_taken(stagefs.open, tiers=[]))
        return stagefs.open(pack, tiers=t[0], runtime=t[1])  # type: ignore[call-arg]

    def open(self, ctx: Context, run: int) -> None:
        super().open(ctx, run)
        self.store = self._store(ctx)

    def origin_bytes(self) -> int | None:
        return int(self.store.origin.stats.bytes_read)

    def close(self) -> None:
        store = getattr(self, "store", None)
        if store is not None:
            store.close()


def _takes_tiers() -> bool:
    import stagefs

    return "tiers" in inspect.signature(stagefs.open).parameters


class StagefsNative(_StagefsBase):
    name, title = "stagefs-native", "stagefs, read_many, no tier"
    settings = (f"stagefs.open(pack) without tiers: every read is a range read of a shard on "
                f"the origin; Store.read_many over the shuffled order, {BATCH} samples a call")
    tiered = False

    def epoch(self, ctx: Context, run: int, epoch: int) -> Iterator[tuple[str, Any]]:
        files = self.files
        order = [files[i] for i in _order(len(files), run, epoch)]
        read_many = self.store.read_many
        for i in range(0, len(order), BATCH):
            batch = order[i:i + BATCH]
            yield from zip(batch, read_many(batch), strict=True)


class StagefsTiers(StagefsNative):
    name, title = "stagefs-tiers", "stagefs + tier, read_many"
    settings = (f"stagefs.open(pack, tiers=[node-local dir]); Store.read_many over a uniform "
                f"shuffle, {BATCH} samples a call")
    tiered = True

    def missing(self) -> str | None:
        return None if _takes_tiers() else "this stagefs.open takes no tiers yet"


def _identity(batch: Any) -> Any:
    return batch


def _taken(fn: Callable[..., Any], **kw: Any) -> dict[str, Any]:
    """The keywords of ``kw`` that ``fn`` takes."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kw.items() if k in params}


def _covering(ds: Any, files: list[str]) -> Any:
    """``ds`` if its samples are the dataset's files, else a ConfigError saying why: a
    FileDataset takes ImageFolder's ROOT/CLASS/FILE, so it leaves out the files at the top
    and reads again those a symlink to a folder leads to (its row would say it read wrong
    bytes)."""
    have = {ds.path_of(i) for i in range(len(ds))}
    left, extra = [f for f in files if f not in have], sorted(have.difference(files))
    if left or extra:
        raise ConfigError(
            "FileDataset reads ImageFolder's ROOT/CLASS/FILE (and follows symlinks to "
            f"folders), so it would not read this dataset's files: {len(left):,} left out "
            f"({', '.join(left[:3]) or '-'}), {len(extra):,} more ({', '.join(extra[:3]) or '-'}"
            "); give --origin a tree of class folders, or leave the torch rows out with "
            "--systems")
    return ds


class StagefsTorch(_StagefsBase):
    name, title = "stagefs-torch", "stagefs.torch + tier, DataLoader"
    settings = (f"as docs/torch.md shows: stagefs.open(pack, tiers=[node-local dir]), "
                f"FileDataset(target='path'), Sampler(prefetch='512MiB', locality=True: the "
                f"window shuffle), DataLoader(batch_size={BATCH}, num_workers=0)")

    def missing(self) -> str | None:
        try:
            import stagefs.torch  # noqa: F401
        except ImportError as exc:
            return f"import stagefs.torch failed: {exc}"
        return None

    def open(self, ctx: Context, run: int) -> None:
        import torch.utils.data

        from stagefs.torch import FileDataset, Sampler

        super().open(ctx, run)
        self.ds = _covering(FileDataset(self.store, root="", target="path"), self.files)
        # open mode whatever $STAGEFS_CLOSED says (stagefs-torch-closed is the closed
        # one); the keywords an older Sampler takes (bench_regress runs older checkouts)
        self.sampler = Sampler(self.ds, seed=run, **_taken(
            Sampler, prefetch="512MiB", locality=True, closed=False))
        self.loader = torch.utils.data.DataLoader(
            self.ds, batch_size=BATCH, sampler=self.sampler, num_workers=0,
            collate_fn=_identity)

    def epoch(self, ctx: Context, run: int, epoch: int) -> Iterator[tuple[str, Any]]:
        self.sampler.set_epoch(epoch)
        for batch in self.loader:
            for data, path in batch:
                yield path, data

    def close(self) -> None:
        close = getattr(getattr(self, "sampler", None), "close", None)
        if close is not None:
            close()
        super().close()


class StagefsTorchClosed(StagefsTorch):
    """The same loader under MLPerf Storage CLOSED rules: nothing informed by the seed."""

    name, title = "stagefs-torch-closed", "stagefs.torch + tier, DataLoader, closed mode"
    settings = (f"as stagefs-torch, with Sampler(closed=True) (STAGEFS_CLOSED=1): no "
                f"staging in the seed's order, no read-ahead, no locality (a uniform "
                f"shuffle); the tier streams each shard once it is first read; "
                f"DataLoader(batch_size={BATCH}, num_workers=0)")

    def open(self, ctx: Context, run: int) -> None:
        import torch.utils.data

        from stagefs.torch import FileDataset, Sampler

        _StagefsBase.open(self, ctx, run)
        self.ds = _covering(FileDataset(self.store, root="", target="path"), self.files)
        self.sampler = Sampler(self.ds, seed=run, closed=True)
        self.loader = torch.utils.data.DataLoader(
            self.ds, batch_size=BATCH, sampler=self.sampler, num_workers=0,
            collate_fn=_identity)


class StagefsIntercept(_StagefsBase):
    name, title = "stagefs-intercept", "stagefs.intercept + tier, open() + read()"
    settings = ("plain open() + read() in a uniform shuffle, under a path served by "
                "stagefs.intercept from stagefs.open(pack, tiers=[node-local dir])")

    def missing(self) -> str | None:
        try:
            from stagefs.posix.intercept import intercept  # noqa: F401
        except ImportError as exc:
            return f"no stagefs.intercept: {exc}"
        return None

    def open(self, ctx: Context, run: int) -> None:
        from stagefs.posix.intercept import intercept

        super().open(ctx, run)
        self.at = os.path.join(ctx.local, "intercept-view")
        self._cm = intercept(self.store, self.at, children=False)
        self._cm.__enter__()

    def epoch(self, ctx: Context, run: int, epoch: int) -> Iterator[tuple[str, Any]]:
        at, files = self.at, self.files
        for i in _order(len(files), run, epoch):
            rel = files[i]
            with open(os.path.join(at, rel), "rb") as f:
                yield rel, f.read()

    def close(self) -> None:
        cm = getattr(self, "_cm", None)
        if cm is not None:
            cm.__exit__(None, None, None)
        super().close()


class StagefsFuse(_StagefsBase):
    """Reads through a FUSE mount that the runner starts for each run (serve_fuse)."""

    name, title = "stagefs-fuse", "stagefs mount + tier (FUSE), open() + read()"
    settings = ("plain open() + read() in a uniform shuffle under a FUSE mount of the pack "
                "(the 'stagefs mount' server, stagefs.posix.fuse.mount, with one node-local "
                "tier)")

    def missing(self) -> str | None:
        try:
            from stagefs.posix.fuse import fuse_available
        except ImportError as exc:
            return f"no stagefs FUSE front end: {exc}"
        return fuse_available()

    def open(self, ctx: Context, run: int) -> None:
        _Base.open(self, ctx, run)

    def origin_bytes(self) -> int | None:
        return None  # counted in the server process (worker.py reads its stats file)

    def close(self) -> None:
        return None

    def epoch(self, ctx: Context, run: int, epoch: int) -> Iterator[tuple[str, Any]]:
        root, files = ctx.fuse_mount, self.files
        if epoch == 0:
            # a training script lists its dataset before the first epoch (ImageFolder,
            # os.walk); through the mount that listing brings every file's attributes
            # (READDIRPLUS), and its time counts in this epoch's
            for _ in os.walk(root):
                pass
        for i in _order(len(files), run, epoch):
            rel = files[i]
            with open(os.path.join(root, rel), "rb") as f:
                yield rel, f.read()


def serve_fuse(ctx: Context, stats_file: str, timeout: float = 60.0) -> subprocess.Popen[bytes]:
    """Start the FUSE server of the pack at ctx.fuse_mount (fuse_serve.py); return it."""
    t = StagefsFuse().tier_args(ctx)
    return start_fuse_server(ctx.out("stagefs"), ctx.fuse_mount, stats_file,
                             [] if t is None else [t[1], *t[0]], timeout=timeout)


def start_fuse_server(pack: str, mountpoint: str, stats_file: str, runtime_tiers: list[str],
                      *, env: dict[str, str] | None = None, timeout: float = 60.0
                      ) -> subprocess.Popen[bytes]:
    """``python -m stagefs.bench.fuse_serve PACK MOUNTPOINT STATS [RUNTIME TIER...]``, once
    its mount is up; the server stopped and the mount gone if it does not come up."""
    from stagefs.posix.fuse import is_mounted, unmount

    os.makedirs(mountpoint, exist_ok=True)
    cmd = [sys.executable, "-m", "stagefs.bench.fuse_serve", pack, mountpoint, stats_file,
           *runtime_tiers]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + timeout
    try:
        while not is_mounted(mountpoint):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise RuntimeError(f"the FUSE mount did not come up: {err[-1000:]}")
            time.sleep(0.05)
    except BaseException:  # Ctrl-C while it starts: the caller never gets it to stop
        proc.terminate()  # the server unmounts on SIGTERM, whether it mounted yet or not
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stderr:
            proc.stderr.close()
        if is_mounted(mountpoint):
            unmount(mountpoint, lazy=True)
        raise
    return proc


def stop_fuse(ctx: Context, proc: subprocess.Popen[bytes]) -> None:
    stop_fuse_server(ctx.fuse_mount, proc)


def stop_fuse_server(mountpoint: str, proc: subprocess.Popen[bytes]) -> None:
    """Unmount what ``start_fuse_server`` mounted and wait for its server to end."""
    from stagefs.posix.fuse import is_mounted, unmount

    try:
        if is_mounted(mountpoint):
            unmount(mountpoint)
    finally:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        if proc.stderr:
            proc.stderr.close()


def all_systems() -> Sequence[System]:
    """Every system, in the order the report lists them."""
    return (PlainLocal(), PlainOrigin(), StagefsNative(), StagefsTorch(), StagefsTorchClosed(),
            StagefsIntercept(),
            StagefsFuse(), StagefsTiers(), WebDatasetSystem(), StreamingSystem(),
            LitDataSystem())
