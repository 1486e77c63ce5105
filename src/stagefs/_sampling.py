"""Epoch orders for the PyTorch sampler: pure functions of numbers, no torch, no I/O.

An epoch's plan is built in three steps, each a function here:

1. ``permutation``: the epoch's global order of sample indices, a function of
   (dataset size, seed, epoch) only, so every rank computes the same one.
2. A split of that order among the ranks: ``split_interleaved`` (as torch's
   DistributedSampler: rank r takes positions r, r+W, r+2W, ...) or, with locality,
   ``split_local`` (each rank takes the samples of the shards its node holds, then the rest
   are dealt out so every rank has the same count).
3. ``resume_pool``: after an interruption, the samples not consumed yet, in the epoch's
   order; they become the pool a new split (with the same or another world size) deals out.

Padding (drop_last=False) follows DistributedSampler: every rank yields ceil(n / W) samples,
so up to W - 1 samples are yielded twice in an epoch (once on two different ranks); no
sample is ever missing. With drop_last=True every rank yields floor(n / W) samples, each at
most once, and the n mod W left over are skipped this epoch (different ones each epoch).
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.ma  # (see below)
import numpy.typing as npt

# np.unique and np.isin import numpy.ma at their first call in a process. The epoch's order
# is made in a thread of the process that forks DataLoader workers: a fork while that
# import is under way leaves its module lock held in the child, whose own first call then
# waits for ever (seen with np.setdiff1d in a batch, store.py). Imported here, once, with
# this module.

__all__ = [
    "Plan",
    "Segment",
    "first_use",
    "local_fraction",
    "permutation",
    "rank_world",
    "resume_pool",
    "split_interleaved",
    "split_local",
    "window_order",
]

Index = npt.NDArray[np.int64]
_MASK64 = 2**64 - 1


def _rng(*keys: int) -> np.random.Generator:
    return np.random.default_rng([k & _MASK64 for k in keys])


def permutation(n: int, seed: int, epoch: int, shuffle: bool = True) -> Index:
    """The epoch's global order: a uniform random permutation of range(n) (or range(n))."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    return _rng(seed, epoch).permutation(n).astype(np.int64)


def _per_rank(n: int, world: int, drop_last: bool) -> int:
    return n // world if drop_last else math.ceil(n / world)


def split_interleaved(pool: Index, world: int, drop_last: bool) -> list[Index]:
    """DistributedSampler's split: pad with the pool's head (or cut its tail), interleave."""
    n = len(pool)
    per = _per_rank(n, world, drop_last)
    total = per * world
    if total > n and n > 0:
        pool = np.resize(pool, total)  # repeats the pool from its head
    pool = pool[:total]
    return [pool[r::world] for r in range(world)]


def window_order(samples: Index, shards: Index, rng: np.random.Generator, window: int) -> Index:
    """Locality-aware shuffle of ``samples`` (whose shards are ``shards``).

    The shards are put in a random order and cut into windows of ``window`` shards; the
    samples of each window are shuffled together. So the windows come in a random order and
    inside a window the order is uniform: a sample's position is random within the span of
    its window (at most ``window`` shards' worth of samples), and consecutive samples come
    from at most ``window`` shards (two windows across a boundary).
    """
    if len(samples) == 0:
        return samples
    uniq = np.unique(shards)
    pos = np.empty(len(uniq), dtype=np.int64)
    pos[rng.permutation(len(uniq))] = np.arange(len(uniq))
    win = pos[np.searchsorted(uniq, shards)] // max(1, window)
    order = np.lexsort((rng.random(len(samples)), win))
    return samples[order]


def _holders_of(holders: Sequence[Collection[int]]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for r, held in enumerate(holders):
        for s in sorted(held):
            out.setdefault(int(s), []).append(r)
    return out


def split_local(
    pool: Index,
    shard_of: Index,
    holders: Sequence[Collection[int]],
    drop_last: bool,
    seed: int,
    epoch: int,
    window: int = 8,
) -> list[Index]:
    """Split ``pool`` among ``len(holders)`` ranks, each taking what its node holds first.

    ``shard_of[i]`` is the shard of sample ``i``; ``holders[r]`` the shards rank r's node
    holds. A shard held by several ranks (ranks on one node, or replicas) is dealt out
    among them in turn. Each rank keeps at most its quota (len(pool) // W, one more for the
    first len(pool) % W ranks); the surplus and the samples no rank holds form a spill, in
    pool order (random), from which ranks short of their quota are filled. Each rank's
    samples are then ordered by ``window_order``. Padding and dropping as in the module doc.
    """
    world = len(holders)
    n = len(pool)
    pshard = shard_of[pool]
    pref = np.full(n, -1, dtype=np.int64)
    by_shard = np.argsort(pshard, kind="stable")
    sorted_shards = pshard[by_shard]
    starts = np.flatnonzero(np.r_[True, sorted_shards[1:] != sorted_shards[:-1]]) if n else pool[:0]
    bounds = [*(int(s) for s in starts), n]
    hmap = _holders_of(holders)
    for a, b in itertools.pairwise(bounds):
        hs = hmap.get(int(sorted_shards[a]))
        if hs:
            pref[by_shard[a:b]] = np.asarray(hs, dtype=np.int64)[np.arange(b - a) % len(hs)]
    quota = [n // world + (1 if (r < n % world and not drop_last) else 0) for r in range(world)]
    keep: list[Index] = []
    spill_parts: list[Index] = [np.flatnonzero(pref < 0)]
    for r in range(world):
        mine = np.flatnonzero(pref == r)
        keep.append(mine[: quota[r]])
        spill_parts.append(mine[quota[r] :])
    spill = np.sort(np.concatenate(spill_parts))
    out: list[Index] = []
    at = 0
    per = _per_rank(n, world, drop_last)
    for r in range(world):
        need = quota[r] - len(keep[r])
        pos = np.concatenate([keep[r], spill[at : at + need]])
        at += need
        mine = window_order(pool[pos], pshard[pos], _rng(seed, epoch, r, 1), window)
        if len(mine) < per and n:  # padding: repeat own head, or the pool's when empty
            extra = mine if len(mine) else pool[r % n : r % n + 1]
            mine = np.concatenate([mine, np.resize(extra, per - len(mine))])
        out.append(mine)
    return out


def local_fraction(orders: Sequence[Index], shard_of: Index,
                   holders: Sequence[Collection[int]]) -> list[float]:
    """For each rank, the share of its samples whose shard its node holds."""
    out = []
    for order, held in zip(orders, holders, strict=True):
        if len(order) == 0:
            out.append(1.0)
            continue
        hs = np.fromiter(held, dtype=np.int64, count=len(held))
        out.append(float(np.isin(shard_of[order], hs).mean()))
    return out


def resume_pool(pool: Index, orders: Sequence[Index], consumed: int) -> Index:
    """The samples of ``pool`` that no rank consumed in its first ``consumed``, in pool order."""
    if consumed <= 0:
        return pool
    done = np.concatenate([o[:consumed] for o in orders])
    return pool[~np.isin(pool, done)]


@dataclass(frozen=True, slots=True)
class Segment:
    """A stretch of an epoch run with one world size (and one holders map, with locality).

    ``consumed``: samples each rank consumed in this stretch (the same on every rank, as
    ranks step in lockstep).
    """

    world: int
    consumed: int = 0
    holders: tuple[tuple[int, ...], ...] | None = None


@dataclass(slots=True)
class Plan:
    """One epoch's plan for every rank, replayed through its resume segments."""

    n: int
    seed: int
    epoch: int
    shuffle: bool
    drop_last: bool
    segments: list[Segment]
    shard_of: Index | None = None
    window: int = 8
    _orders: list[Index] | None = field(default=None, repr=False)

    def orders(self) -> list[Index]:
        """Each rank's order for the current (last) segment, from its start."""
        if self._orders is None:
            pool = permutation(self.n, self.seed, self.epoch, self.shuffle)
            orders: list[Index] = []
            for i, seg in enumerate(self.segments):
                if i:
                    pool = resume_pool(pool, orders, self.segments[i - 1].consumed)
                orders = self._split(pool, seg, i)
            self._orders = orders
        return self._orders

    def _split(self, pool: Index, seg: Segment, i: int) -> list[Index]:
        if seg.holders is None:
            return split_interleaved(pool, seg.world, self.drop_last)
        if self.shard_of is None:
            raise ValueError("a locality plan needs the shard of every sample")
        return split_local(pool, self.shard_of, seg.holders, self.drop_last, self.seed,
                           self.epoch + (i << 32), self.window)

    def remaining(self, rank: int) -> Index:
        """What ``rank`` still has to yield in this epoch."""
        return self.orders()[rank][self.segments[-1].consumed :]


def rank_world(environ: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """(rank, world size) from the launcher's variables: torchrun, Slurm, Open MPI, MPICH."""
    env = os.environ if environ is None else environ
    for rank_var, size_var in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"),
                               ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("PMI_RANK", "PMI_SIZE")):
        if env.get(rank_var, "") != "" and env.get(size_var, "") != "":
            try:
                rank, world = int(env[rank_var]), int(env[size_var])
            except ValueError:
                raise ValueError(f"{rank_var}={env[rank_var]!r} / {size_var}="
                                 f"{env[size_var]!r}: not integers") from None
            if not 0 <= rank < world:
                raise ValueError(f"{rank_var}={rank} is not in [0, {size_var}={world})")
            return rank, world
    return None


def first_use(order: Index, shard_of: Index) -> Index:
    """The shards of ``order``'s samples, each once, in the order they are first needed."""
    shards = shard_of[order]
    _, first = np.unique(shards, return_index=True)
    return shards[np.sort(first)]
