"""The systems ``stagefs bench`` compares, one small class each behind one protocol.

A system turns the raw dataset into its own form (``convert``), opens it (``open``) and
yields ``(key, bytes)`` for one shuffled epoch (``epoch``), where ``key`` is the sample's
path relative to the raw dataset, so that every system's epochs can be checked against
the same set of samples and bytes. The runner times ``convert`` and measures each epoch in
a separate process (see measure.py); it never looks inside a system.

The peers (WebDataset, MosaicML Streaming, LitData) are in peers.py.
"""

from __future__ import annotations

import inspect
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

__all__ = ["Context", "System", "all_systems"]

BATCH = 64  # samples per read_many call / DataLoader batch


@dataclass(frozen=True, slots=True)
class Context:
    """Where everything is, the same for every system (plain JSON for the worker process)."""

    raw: str  # the raw dataset (on the origin)
    conv: str  # where conversions are written (next to the raw dataset: on the origin)
    local: str  # node-local scratch: local copies, caches, tiers
    index: str  # a file of "relative path<TAB>size" lines, sorted, written by the runner
    fuse_mount: str = ""  # the mount point of a running 'stagefs mount' (FUSE only)

    def out(self, system: str) -> str:
        return os.path.join(self.conv, system)

    def scratch(self, system: str) -> str:
        return os.path.join(self.local, system)

    def files(self) -> list[str]:
        with open(self.index) as f:
            return [line.split("\t", 1)[0] for line in f if line.strip()]


class System(Protocol):
    """One way of reading the dataset."""

    name: str  # short id used in files and on the command line
    title: str  # what the report calls it
    interpreter: str  # "main" (this Python) or "peers" (the peers' Python)
    settings: str  # the settings used for shuffled reading, and where they are documented
    on_origin: bool  # reads its data from the origin (else from a node-local copy)

    def missing(self) -> str | None:
        """Why it cannot run here, or None. Called in the interpreter that runs it."""
        ...

    def convert(self, ctx: Context) -> str:
        """Write this system's form of the dataset; return the directory it is in."""
        ...

    def open(self, ctx: Context, run: int) -> None:
        """Get ready to read (run ``run`` starts from empty local caches)."""
        ...

    def epoch(self, ctx: Context, run: int, epoch: int) -> Iterator[tuple[str, Any]]:
        """One shuffled epoch: every sample once, as (key, bytes-like)."""
        ...

    def origin_bytes(self) -> int | None:
        """Bytes read from the origin so far, if the system counts them itself."""
        ...

    def close(self) -> None: ...


def _order(n: int, run: int, epoch: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    return np.random.default_rng(run * 1000 + epoch).permutation(n)


class _Base:
    name = ""
    title = ""
    interpreter = "main"
    settings = ""
    on_origin = True

    def missing(self) -> str | None:
        return None

    def open(self, ctx: Context, run: int) -> None:
        self.files = ctx.files()

    def origin_bytes(self) -> int | None:
        return None

    def close(self) -> None:
        return None


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
        shutil.copytree(ctx.raw, dest)
        return dest

    def _root(self, ctx: Context) -> str:
        return ctx.scratch(self.name)


class _StagefsBase(_Base):
    """Systems reading the stagefs pack written once next to the raw data."""

    pack_name = "stagefs"

    def convert(self, ctx: Context) -> str:
        import stagefs

        dest = ctx.out(self.pack_name)
        stagefs.pack(ctx.raw, dest, jobs=2, overwrite=True, progress=False)
        return dest

    def _store(self, ctx: Context, tiers: list[str] | None = None) -> Any:
        import stagefs

        pack = ctx.out(self.pack_name)
        if tiers:
            return stagefs.open(pack, tiers=tiers)  # type: ignore[call-arg]
        return stagefs.open(pack)

    def open(self, ctx: Context, run: int) -> None:
        super().open(ctx, run)
        self.store = self._store(ctx)

    def origin_bytes(self) -> int | None:
        return int(self.store.origin.stats.bytes_read)

    def close(self) -> None:
        store = getattr(self, "store", None)
        if store is not None:
            store.close()


class StagefsNative(_StagefsBase):
    name, title = "stagefs-native", "stagefs, Store.read_many"
    settings = f"Store.read_many over the shuffled order, {BATCH} samples a call"

    def epoch(self, ctx: Context, run: int, epoch: int) -> Iterator[tuple[str, Any]]:
        files = self.files
        order = [files[i] for i in _order(len(files), run, epoch)]
        read_many = self.store.read_many
        for i in range(0, len(order), BATCH):
            batch = order[i:i + BATCH]
            yield from zip(batch, read_many(batch), strict=True)


class StagefsTiers(StagefsNative):
    name, title = "stagefs-tiers", "stagefs + memory tier, read_many"
    settings = (f"stagefs.open(pack, tiers=[node-local dir]); read_many, {BATCH} a call; "
                "the tier starts empty in each run")

    def missing(self) -> str | None:
        import stagefs

        if "tiers" not in inspect.signature(stagefs.open).parameters:
            return "this stagefs.open takes no tiers yet"
        return None

    def open(self, ctx: Context, run: int) -> None:
        _Base.open(self, ctx, run)
        tier = os.path.join(ctx.scratch(self.name), "tier0")
        shutil.rmtree(tier, ignore_errors=True)
        os.makedirs(tier)
        self.store = self._store(ctx, tiers=[tier])


def _identity(batch: Any) -> Any:
    return batch


class StagefsTorch(_StagefsBase):
    name, title = "stagefs-torch", "stagefs.torch FileDataset + DataLoader"
    settings = (f"FileDataset(target='path') + stagefs Sampler(prefetch=256MiB), DataLoader "
                f"batch_size={BATCH}, num_workers=0 (batched __getitems__)")

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
        self.ds = FileDataset(self.store, root="", target="path")
        try:
            self.sampler = Sampler(self.ds, seed=run, prefetch="256MiB")
        except TypeError:  # an older Sampler without prefetch
            self.sampler = Sampler(self.ds, seed=run)
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


class StagefsIntercept(_StagefsBase):
    name, title = "stagefs-intercept", "stagefs.intercept, open() + read()"
    settings = "plain open() + read() under a path served by stagefs.intercept, random order"

    def missing(self) -> str | None:
        try:
            from stagefs.posix.intercept import intercept  # noqa: F401
        except ImportError as exc:
            return f"no stagefs.intercept: {exc}"
        return None

    def open(self, ctx: Context, run: int) -> None:
        from stagefs.posix.intercept import intercept

        super().open(ctx, run)
        self.at = os.path.join(ctx.scratch(self.name), "view")
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
    """Reads through a 'stagefs mount' that the runner starts (mount_fuse) for each run."""

    name, title = "stagefs-fuse", "stagefs mount (FUSE), open() + read()"
    settings = "plain open() + read() under a 'stagefs mount' of the pack, random order"

    def missing(self) -> str | None:
        try:
            from stagefs.posix.fuse import fuse_available
        except ImportError as exc:
            return f"no stagefs FUSE front end: {exc}"
        return fuse_available()

    def open(self, ctx: Context, run: int) -> None:
        _Base.open(self, ctx, run)

    def origin_bytes(self) -> int | None:
        return None  # the server process's reads, counted by the runner from /proc

    def close(self) -> None:
        return None

    def epoch(self, ctx: Context, run: int, epoch: int) -> Iterator[tuple[str, Any]]:
        root, files = ctx.fuse_mount, self.files
        for i in _order(len(files), run, epoch):
            rel = files[i]
            with open(os.path.join(root, rel), "rb") as f:
                yield rel, f.read()


def mount_fuse(ctx: Context, timeout: float = 60.0) -> subprocess.Popen[bytes]:
    """Start 'stagefs mount --foreground' of the pack at ctx.fuse_mount; return the server."""
    from stagefs.posix.fuse import is_mounted

    os.makedirs(ctx.fuse_mount, exist_ok=True)
    cmd = [sys.executable, "-m", "stagefs.cli", "mount", ctx.out("stagefs"), ctx.fuse_mount,
           "--foreground"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    while not is_mounted(ctx.fuse_mount):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise RuntimeError(f"stagefs mount did not come up: {err[-1000:]}")
        time.sleep(0.05)
    return proc


def unmount_fuse(ctx: Context, proc: subprocess.Popen[bytes]) -> None:
    from stagefs.posix.fuse import is_mounted, unmount

    try:
        if is_mounted(ctx.fuse_mount):
            unmount(ctx.fuse_mount)
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
    from stagefs.bench.peers import LitDataSystem, StreamingSystem, WebDatasetSystem

    return (PlainLocal(), PlainOrigin(), StagefsNative(), StagefsTorch(), StagefsIntercept(),
            StagefsFuse(), StagefsTiers(), WebDatasetSystem(), StreamingSystem(),
            LitDataSystem())
