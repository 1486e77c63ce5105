"""Data-stall accounting: how long each training step waited for its batch.

Wrap the loader; iterating the wrapper times each ``next()`` (the wait for data) and the
time between batches (the step itself). An epoch's stall share is wait / (wait + step), the
measure of DS-Analyzer. Each finished epoch is also written to
``$STAGEFS_RUNTIME/stall-<pid>.json`` (when the variable is set) for ``stagefs status``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, Generic, TypeGuard, TypeVar

from stagefs._fsutil import atomic_write
from stagefs._sampling import rank_world
from stagefs.runtime import Runtime
from stagefs.torch._sampler import Sampler

__all__ = ["EpochStall", "StallMeter"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class EpochStall:
    """One epoch (one pass over the loader) of a training loop."""

    epoch: int
    steps: int
    wait_s: float  # time spent waiting for batches, the first one included
    step_s: float  # time spent in the loop body, between batches
    first_wait_s: float  # the wait for the first batch (worker start-up, first reads)
    # the loader's stagefs Sampler's mode as the pass started: "closed" (MLPerf Storage
    # CLOSED rules), "open", or None (another sampler); for an audit of which mode ran
    mode: str | None = None

    @property
    def total_s(self) -> float:
        return self.wait_s + self.step_s

    @property
    def stall(self) -> float:
        """Share of the epoch spent waiting for data (none in a pass without a batch: a
        resumed epoch that had ended, whose one wait is the loader's end)."""
        return self.wait_s / self.total_s if self.total_s > 0 and self.steps else 0.0

    @property
    def steady_stall(self) -> float:
        """The stall share without the first batch's wait."""
        rest = self.total_s - self.first_wait_s
        return (self.wait_s - self.first_wait_s) / rest if rest > 0 and self.steps else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "stall": self.stall, "steady_stall": self.steady_stall}

    def __str__(self) -> str:
        return (f"epoch {self.epoch}: {self.steps} steps, data stall {self.stall:.1%} "
                f"({self.wait_s:.2f} s waiting, {self.step_s:.2f} s in steps; "
                f"{self.steady_stall:.1%} after the first batch)")


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def _this_rank() -> int | None:
    """This process's rank for its records, as the Sampler finds it (torch.distributed, then
    the launcher's variables), looked up at each write: a script initialises
    torch.distributed after it makes its loader as often as before. None: not told."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        found = rank_world()
    except ValueError:  # malformed variables: the Sampler says so; a record is best effort
        return None
    return found[0] if found else None


class StallMeter(Generic[T]):
    """Iterate ``loader`` through this to measure the data stall of every epoch.

    ``meter.epochs`` lists the finished epochs (each numbered as the loader's sampler
    numbers it, a resumed run's too; else by pass), ``meter.last`` the latest one. ``runtime``:
    the directory to write ``stall-<pid>.json`` into; by default ``$STAGEFS_RUNTIME``, else
    the job's default runtime directory if a Store has made it; ``write=False`` writes none.
    ``rank``: recorded with the epochs; by default the rank torch.distributed or the
    launcher gives, so that ``stagefs status`` tells a DDP job's ranks apart.
    """

    def __init__(self, loader: Iterable[T], *, runtime: str | None = None,
                 rank: int | None = None, write: bool = True,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.loader = loader
        self.clock = clock  # seconds; tests pass one they move by hand
        if runtime is None and write:
            rt = Runtime()
            runtime = rt.path if rt.explicit or rt.exists() else None
        self.runtime = runtime if write else None
        self.rank = rank
        self.epochs: list[EpochStall] = []

    @property
    def last(self) -> EpochStall | None:
        return self.epochs[-1] if self.epochs else None

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[T]:
        # the sampler's epoch (set_epoch, load_state_dict: a resumed run's), else the pass's
        sampler = _sampler_of(self.loader)
        told = getattr(sampler, "epoch", None)
        epoch: int = told if _is_int(told) else len(self.epochs)
        closed = getattr(sampler, "closed", None) if isinstance(sampler, Sampler) else None
        mode = None if closed is None else "closed" if closed else "open"
        clock = self.clock
        wait = step = first = 0.0
        steps = 0
        it = iter(self.loader)
        prev: float | None = None
        try:
            while True:
                t0 = clock()
                if prev is not None:
                    step += t0 - prev
                try:
                    batch = next(it)
                except StopIteration:
                    wait += clock() - t0
                    prev = None
                    break
                t1 = clock()
                wait += t1 - t0
                if steps == 0:
                    first = t1 - t0
                steps += 1
                prev = t1
                yield batch
        finally:  # also when the loop is left early
            if prev is not None:
                step += clock() - prev
            self._record(EpochStall(epoch, steps, wait, step, first, mode))

    def _record(self, e: EpochStall) -> None:
        self.epochs.append(e)
        if self.runtime:
            self.write(os.path.join(self.runtime, f"stall-{os.getpid()}.json"))

    def write(self, path: str) -> None:
        """Write every finished epoch to ``path`` as JSON (atomically)."""
        rank = self.rank if self.rank is not None else _this_rank()
        doc = {"pid": os.getpid(), "rank": rank, "updated": time.time(),
               "epochs": [e.as_dict() for e in self.epochs]}
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        atomic_write(path, json.dumps(doc, indent=1))

    def report(self) -> str:
        """A table of every finished epoch."""
        from stagefs._table import table

        return table(["epoch", "steps", "wait s", "step s", "stall", "after 1st batch"],
                     [[e.epoch, e.steps, f"{e.wait_s:.2f}", f"{e.step_s:.2f}",
                       f"{e.stall:.1%}", f"{e.steady_stall:.1%}"] for e in self.epochs])


def _sampler_of(loader: object) -> object:
    """The sampler that deals ``loader``'s epochs: its ``sampler``, or the one its
    ``batch_sampler`` draws from (``DataLoader(batch_sampler=BatchSampler(Sampler(...),
    ...))``, where the loader's own ``sampler`` is torch's default, which has no epoch: the
    passes were numbered from 0 and a closed-mode Sampler's epochs recorded with no mode)."""
    outer = getattr(loader, "sampler", None)
    inner = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    if not isinstance(outer, Sampler) and (
            isinstance(inner, Sampler) or (not _is_int(getattr(outer, "epoch", None))
                                           and _is_int(getattr(inner, "epoch", None)))):
        return inner
    return outer
