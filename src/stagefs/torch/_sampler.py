"""Sampler: a distributed sampler that knows this epoch's order and the next one's.

The order itself is computed by stagefs._sampling (pure, property-tested); this module finds
the rank and world size, learns which shards each rank's node holds, drives the prefetching
and keeps the resumable state.
"""

from __future__ import annotations

import logging
import operator
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch.distributed as dist
import torch.utils.data

from stagefs._sampling import Plan, Segment, first_use, local_fraction, rank_world
from stagefs.config import env, env_flag, parse_size
from stagefs.errors import ConfigError
from stagefs.format.checksum import checksum
from stagefs.torch._dataset import EpochPlan, Upcoming
from stagefs.torch._prefetch import Prefetcher, TierAhead

__all__ = ["Sampler"]

_STATE_VERSION = 1
_STATE_KEYS = ("version", "n", "seed", "epoch", "shuffle", "drop_last", "locality", "window",
               "segments")  # and "dataset", absent from a state saved before it was added
DEFAULT_BUDGET = 256 * 2**20
Holders = tuple[tuple[int, ...], ...]
log = logging.getLogger("stagefs")


def closed_mode() -> bool:
    """``$STAGEFS_CLOSED``: MLPerf Storage CLOSED rules (nothing informed by the seed)."""
    return env_flag("closed", default=False)


def _rank_world(rank: int | None, world: int | None) -> tuple[int, int]:
    if rank is not None or world is not None:
        # Python ints: numpy's would end up in state_dict, which json and
        # torch.load(weights_only=True) (torch's default) then refuse
        rank = None if rank is None else _whole(rank, "Sampler's rank")
        world = None if world is None else _whole(world, "Sampler's world_size")
        if rank is None or world is None or not 0 <= rank < world:
            raise ConfigError(f"rank={rank}, world_size={world}: give both, with "
                              "0 <= rank < world_size")
        return rank, world
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        found = rank_world()
    except ValueError as exc:
        raise ConfigError(f"cannot tell this process's rank: {exc}") from None
    return found or (0, 1)


def _tier_reader(dataset: Any, shard_of: npt.NDArray[np.int64]) -> Callable[[Sequence[int]], None]:
    """Reads samples whose shard is not whole in a tier yet (the store writes what it reads
    from the origin into the tiers). Holds the dataset, not the sampler: a sampler dropped
    without close() is still collected, and its __del__ stops the read-ahead."""
    looked, held = 0.0, set[int]()

    def read(indices: Sequence[int]) -> None:
        nonlocal looked, held
        now = time.monotonic()
        if now - looked > 0.5:
            looked, held = now, set(dataset.store.held_shards())
        todo = [i for i in indices if int(shard_of[i]) not in held]
        if todo:  # not counted as samples read: the workers read them, and count them, next
            dataset.read_samples(todo, count=False)

    return read


def _files_of(dataset: Any) -> tuple[Any, npt.NDArray[np.int64] | None]:
    """The stagefs dataset the sampler's indices read, and where each index is in it: the
    dataset itself (no map), or the FileDataset under torch Subsets (``random_split``
    carving a validation set out of ``train``), whose indices the Subsets map; ``(None,
    None)`` for any other dataset (no locality, no read-ahead)."""
    index: npt.NDArray[np.int64] | None = None
    while isinstance(dataset, torch.utils.data.Subset):
        sub = np.asarray(dataset.indices, dtype=np.int64)  # negative: from the end, as a list's
        sub = np.where(sub < 0, sub + len(dataset.dataset), sub)  # type: ignore[arg-type]
        index = sub if index is None else sub[index]
        dataset = dataset.dataset
    if not hasattr(dataset, "shard_of"):
        return None, None
    return dataset, index


def _is_whole(x: object) -> bool:
    """An int (numpy's too), not a bool or a float."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _whole(x: object, what: str) -> int:
    """``x`` as an int: a whole number (numpy's and torch's too), not a float or a string."""
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{what} is a whole number, not {x!r}")
    try:
        return operator.index(x)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} is a whole number, not {type(x).__name__} ({x!r})") from None


def _flag(x: object, what: str) -> bool:
    """``x`` as a bool: True or False (numpy's too, or 0 and 1); a string is refused by
    name, not taken as true: ``"false"`` or ``"0"`` from a config file or a command line ran
    the other mode (``closed``) or shuffled (``shuffle``) without a word."""
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    try:
        whole = operator.index(x)  # type: ignore[arg-type]
    except TypeError:
        whole = None
    if whole in (0, 1):
        return bool(whole)
    raise TypeError(f"{what} is True or False, not {type(x).__name__} ({_short(x)})"
                    + (": a string is not read as a switch" if isinstance(x, str) else ""))


def _short(x: object) -> str:
    text = repr(x)
    return text if len(text) <= 200 else text[:200] + "..."


class Sampler(torch.utils.data.Sampler[int]):
    """Yields this rank's sample indices of ``dataset`` for the current epoch.

    Every sample is yielded exactly once per epoch across all ranks; with
    ``drop_last=False`` each rank yields ceil(n / W) indices (the up to W - 1 extra ones
    repeat samples, as torch's DistributedSampler), with ``drop_last=True`` floor(n / W).
    Rank and world size: ``rank``/``world_size`` if given, else torch.distributed when it
    is initialised, else RANK/WORLD_SIZE, SLURM_PROCID/SLURM_NTASKS,
    OMPI_COMM_WORLD_RANK/SIZE or PMI_RANK/SIZE, else a single rank.

    ``locality=True``: each rank gets the samples of the shards its node holds first
    (``Store.held_shards()``, gathered from every rank through torch.distributed, or given
    as ``held_by[rank]``), shuffled in windows of ``window`` shards (docs/torch.md states
    the bound on the randomness lost). ``local_fraction`` tells the share it got.

    ``prefetch``: a byte budget ("512MiB", an int, or True for 256 MiB). As soon as an
    epoch's order is known (the Sampler is made, ``set_epoch``, ``load_state_dict``) the
    store is asked to stage the shards in the order this epoch and the next will first use
    them (``Store.prefetch``), and, with tiers, the epoch's first samples are read into
    them from this process until the loop starts (within the budget). During the loop the
    next samples' bytes are read ahead into memory within the budget: in this process for
    a dataset read here (num_workers=0); without tiers, by each DataLoader worker for the
    batches it will be given; with tiers, the workers' batched reads (several in flight,
    Store.read_entries) fetch what the tiers do not hold yet. ``prefetch_threads``: the
    read-ahead's threads in this process (default: one with tiers, 32 samples a batched
    read, whose origin reads run in parallel and wait for the tiers' streams; four without,
    16 samples a read; a worker's read-ahead without tiers has half as many).

    ``closed=True`` (default: ``$STAGEFS_CLOSED=1``), for MLPerf Storage's CLOSED division:
    nothing the storage does is informed by the seed. ``prefetch`` is ignored (no staging in
    the order of first use, no read-ahead of samples) and ``locality`` is refused; the
    store's tiers still stream each shard once it is first read, in shard order. The mode is
    logged (INFO); ``closed=False`` with ``$STAGEFS_CLOSED=1`` runs open mode, with a warning.
    """

    def __init__(
        self,
        dataset: Any,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        locality: bool = False,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        window: int = 8,
        prefetch: bool | int | str | None = None,
        prefetch_threads: int | None = None,
        held_by: Sequence[Sequence[int]] | None = None,
        closed: bool | None = None,
    ) -> None:
        self.dataset = dataset
        self.closed = closed_mode() if closed is None else _flag(closed, "Sampler's closed")
        if closed is not None and not self.closed and closed_mode():
            # the auditor's switch, overridden by the script: said, never silently open
            log.warning("STAGEFS_CLOSED=%s, but this Sampler was made with closed=False: it runs "
                        "in open mode (staging and read-ahead in the seed's order, locality), "
                        "not under MLPerf Storage CLOSED rules; drop closed=False for closed "
                        "mode", env("closed"))
        locality = _flag(locality, "Sampler's locality")
        if self.closed and locality:
            raise ConfigError("locality=True orders samples by what the nodes hold: not "
                              "allowed under closed=True ($STAGEFS_CLOSED=1, MLPerf Storage "
                              "CLOSED rules); drop locality=True, or run without closed mode")
        self.n = len(dataset)
        self.shuffle = _flag(shuffle, "Sampler's shuffle")
        self.drop_last = _flag(drop_last, "Sampler's drop_last")
        self.seed = _whole(seed, "Sampler's seed")  # a float or a string is not truncated
        self.locality, self.window = locality, _whole(window, "Sampler's window")
        if self.window < 1:
            raise ConfigError(f"window={window}: a window is a number of shards, at least 1")
        self.rank, self.world_size = _rank_world(rank, world_size)
        self._told = rank is not None  # rank/world_size given, not found (see _check_world)
        if held_by is not None and len(held_by) != self.world_size:
            raise ConfigError(f"held_by has {len(held_by)} entries for {self.world_size} ranks")
        self._held_by = held_by
        budget = self._budget(prefetch)  # checked in closed mode too: a typo is one there
        self.budget = 0 if self.closed else budget  # closed: no read-ahead
        if self.closed:
            log.info("Sampler in closed mode (MLPerf Storage CLOSED rules, %s): nothing the "
                     "storage does is informed by the seed%s",
                     "closed=True" if closed else f"STAGEFS_CLOSED={env('closed')}",
                     f"; prefetch={prefetch!r} is ignored" if budget else "")
        self.prefetch_threads = prefetch_threads  # None: by the store (_ahead_threads)
        # the FileDataset read (the dataset, or the one under its Subsets) and the map
        # from the sampler's indices to its own: the order is dealt over ``dataset`` and
        # read ahead by the FileDataset's indices, which the DataLoader's fetches carry
        self._files, self._index = _files_of(dataset)
        if (self.locality or self.budget) and self._files is None:
            raise ConfigError(
                f"locality and prefetch need a stagefs dataset, not {type(dataset).__name__}: "
                "a FileDataset, or a torch Subset of one (random_split); drop locality and "
                "prefetch for another dataset")
        shards = self._files.shard_of() if self._files is not None else None
        self._file_shards: npt.NDArray[np.int64] | None = shards  # by the FileDataset's index
        self._shard_of: npt.NDArray[np.int64] | None = (
            shards if shards is None or self._index is None else shards[self._index])
        self.epoch = 0
        self._segments: list[Segment] | None = None  # None: from the epoch's start
        self._plan: Plan | None = None
        self._yielded = 0  # indices yielded since this epoch's start or the resume point
        # the epoch whose iteration ended (plan, indices yielded), until the next one starts:
        # a DataLoader's workers run ahead, so its loop checkpoints after the sampler ended
        self._ended: tuple[Plan, int] | None = None
        self._resumed = False  # load_state_dict's resume point, not iterated from yet
        self.prefetcher: Prefetcher | None = None
        self.tier_ahead: TierAhead | None = None
        self._staged_plan: Plan | None = None  # the plan whose shards were staged
        self._digest: str | None = None  # which files the samples are (_dataset_digest)
        # every rank's holdings, gathered through torch.distributed where every rank calls
        # (here and set_epoch), never by len(), local_fraction or state_dict, which a
        # training script may call on one rank alone (a collective there waited forever)
        self._gathered: Holders | None = None
        self._gather_holders()
        self._tell_workers()
        self._read_ahead_early()

    @staticmethod
    def _budget(prefetch: bool | int | str | None) -> int:
        if prefetch is None or prefetch is False:
            return 0
        if prefetch is True:
            return DEFAULT_BUDGET
        if isinstance(prefetch, str):
            try:
                return parse_size(prefetch)
            except ConfigError as exc:
                raise ConfigError(f"Sampler's prefetch={prefetch!r}: {exc}") from None
        try:
            budget = _whole(prefetch, "Sampler's prefetch")
        except TypeError:
            raise ConfigError(f"Sampler's prefetch={prefetch!r}: give a byte budget, as a "
                              "number of bytes or a size ('512MiB'), or True") from None
        if budget < 0:
            raise ConfigError(f"Sampler's prefetch={prefetch!r}: a byte budget cannot be "
                              "negative")
        return budget

    # -- epochs ----------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning (call it on every rank, every epoch).

        Right after ``load_state_dict`` of a state saved in epoch ``epoch`` (before the
        next iteration), the epoch goes on from the resume point instead: the usual loop
        ``for epoch in range(start, end): sampler.set_epoch(epoch)`` resumes."""
        epoch = _whole(epoch, "set_epoch's epoch")
        if epoch < 0:
            raise ConfigError(f"epoch {epoch}: epochs are numbered from 0")
        self._gather_holders()  # every rank calls set_epoch: the holdings as they are now
        plan = self._plan
        if epoch == self.epoch and self._resumed:
            return  # the resume point just loaded (and its read-ahead under way)
        if (epoch == self.epoch and plan is not None and not self.locality
                and self._yielded == 0 and [s.consumed for s in plan.segments] == [0]):
            return  # this epoch's start is planned already (and its read-ahead under way)
        self.epoch = epoch
        self._segments = None
        self._plan = None
        self._yielded = 0
        self._ended = None
        self._resumed = False
        self._tell_workers()
        self._read_ahead_early()

    def _holders(self) -> Holders | None:
        if not self.locality:
            return None
        if self._held_by is not None:
            return tuple(tuple(sorted(int(s) for s in h)) for h in self._held_by)
        if self.world_size == 1:
            return (self._held_here(),)
        if self._gathered is None:  # torch.distributed was initialised after the sampler
            self._gather_holders()
        if self._gathered is not None:
            return self._gathered
        raise ConfigError(
            f"locality=True with {self.world_size} ranks needs to know what every rank's node "
            "holds: initialise torch.distributed first, or pass held_by=[shards of rank 0, ...]"
        )

    def _held_here(self) -> tuple[int, ...]:
        held = getattr(getattr(self._files, "store", None), "held_shards", None)
        return tuple(sorted(int(s) for s in held())) if held is not None else ()

    def _gather_holders(self) -> None:
        """Gather every rank's holdings (a collective call: only from the constructor and
        ``set_epoch``, which every rank calls, in the same order). Nothing to gather without
        locality, with ``held_by``, on one rank, or without torch.distributed."""
        if (not self.locality or self._held_by is not None or self.world_size == 1
                or not (dist.is_available() and dist.is_initialized())):
            return
        self._check_world()
        here = dist.get_rank(), dist.get_world_size()
        if here != (self.rank, self.world_size):
            # rank/world_size given for a group of processes (data parallel within a larger
            # world): the gathered list is per process of the whole world, not per rank of
            # the sampler's (it failed deep inside the gather, or dealt holdings to the
            # wrong ranks)
            raise ConfigError(
                f"locality=True with rank={self.rank}, world_size={self.world_size} given, but "
                f"torch.distributed has this process as rank {here[0]} of {here[1]}: the "
                "holdings cannot be gathered per rank of the sampler; pass held_by=[shards of "
                f"rank 0's node, ...] ({self.world_size} lists, store.held_shards() on each)")
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, self._held_here())
        self._gathered = tuple(tuple(int(s) for s in h) for h in out)

    def _check_world(self) -> None:
        """A Sampler that found its rank before torch.distributed was initialised (DDP
        started with torch.multiprocessing.spawn: no launcher variables) took one rank of
        one; every rank would then read the whole epoch, silently. Said, not adapted to:
        the order and any saved state are a function of the world size."""
        if self._told or not (dist.is_available() and dist.is_initialized()):
            return
        now = dist.get_rank(), dist.get_world_size()
        if now != (self.rank, self.world_size):
            raise ConfigError(
                f"this Sampler was made before torch.distributed was initialised and took "
                f"rank {self.rank} of {self.world_size}; this process is rank {now[0]} of "
                f"{now[1]}: make the Sampler after init_process_group, or pass rank= and "
                "world_size=")

    def plan(self) -> Plan:
        """This epoch's plan for every rank (computed once per epoch)."""
        if self._plan is None:
            self._check_world()
            holders = self._holders()
            segs = list(self._segments or [])
            if not segs or segs[-1].world != self.world_size or segs[-1].holders != holders:
                segs.append(Segment(self.world_size, 0, holders))
            self._segments = segs
            self._plan = Plan(self.n, self.seed, self.epoch, self.shuffle, self.drop_last, segs,
                              self._shard_of, self.window)
        return self._plan

    def order(self) -> npt.NDArray[np.int64]:
        """The indices this rank will yield in this epoch (from the resume point)."""
        return self.plan().remaining(self.rank)

    def next_order(self) -> npt.NDArray[np.int64]:
        """The indices this rank will yield in the next epoch (with today's holders)."""
        segs = [Segment(self.world_size, 0, self.plan().segments[-1].holders)]
        return Plan(self.n, self.seed, self.epoch + 1, self.shuffle, self.drop_last, segs,
                    self._shard_of, self.window).remaining(self.rank)

    @property
    def local_fractions(self) -> list[float]:
        """For every rank, the share of its samples (this epoch) that its node holds."""
        plan = self.plan()
        holders = plan.segments[-1].holders
        if holders is None or self._shard_of is None:
            raise ConfigError("local_fraction is measured only with locality=True")
        return local_fraction(plan.orders(), self._shard_of, holders)

    @property
    def local_fraction(self) -> float:
        """The share of this rank's samples (this epoch) that its node holds."""
        return self.local_fractions[self.rank]

    def __len__(self) -> int:
        return len(self.order())

    def __iter__(self) -> Iterator[int]:
        self._ended, self._resumed = None, False
        order = self.order()
        plan = self.plan()
        self._yielded = 0
        self._start_prefetch(order)
        for i in order.tolist():
            self._yielded += 1
            yield i
        # the epoch is done: iterating again without set_epoch repeats it from its start;
        # until then state_dict still tells where this epoch stands (a DataLoader with
        # workers ends the sampler's iteration a few batches before its loop ends)
        self._ended = (plan, self._yielded)
        self._segments, self._plan, self._yielded = None, None, 0

    # -- prefetching -----------------------------------------------------------------------

    def _start_prefetch(self, order: npt.NDArray[np.int64]) -> None:
        if not self.budget or self._shard_of is None:
            drop = getattr(self._files, "_set_prefetcher", None)
            if self.closed and drop is not None:  # an earlier Sampler's, in its order
                drop(None)
            return
        self._stage(order)
        # the loop has started: from here the DataLoader's workers read their batches
        # (Store.read_entries: several reads in flight each) and this process, whose one thread
        # drives the loop, is left alone: a read-ahead here took the GIL from it
        # (docs/torch.md, "Measured"). Without workers, the Prefetcher takes over.
        self._stop_tier_ahead(wait=False)
        threads, chunk = self._ahead_threads()
        p = Prefetcher(self._files._read_ahead, self._files.sizes(), self._in_files(order),
                       self.budget, threads=threads, chunk=chunk)
        self.prefetcher = p
        self._files._set_prefetcher(p)  # started on first use in this process

    def _ahead_threads(self) -> tuple[int, int]:
        """Threads and samples a read of the in-memory read-ahead. With tiers one thread
        and a batch's worth a read: the batched read already runs its origin reads in
        parallel and waits for the streams on their shards, and more threads racing the
        streams took the interpreter lock from the loop (four threads of 16: the cold
        epoch at 0.76 of closed mode's, one of 32: 0.98, the stall the same)."""
        if self.prefetch_threads is not None:
            return max(1, self.prefetch_threads), 16
        return (1, 32) if self._tiered() else (4, 16)

    def _stage(self, order: npt.NDArray[np.int64]) -> None:
        """Once per epoch plan: hand the store the shards in order of first use (this
        epoch, then the next)."""
        stage = getattr(self._files.store, "prefetch", None)
        if stage is None or self._staged_plan is self._plan:
            return
        assert self._shard_of is not None
        self._staged_plan = self._plan
        both = np.concatenate([order, self.next_order()])
        stage([int(s) for s in first_use(both, self._shard_of)])

    def _read_ahead_early(self) -> None:
        """The order of an epoch is known once its seed, epoch and resume point are: the
        shards are staged and, with tiers, the epoch's first samples read into them from
        now until the loop starts (the DataLoader starts its workers and hands them their
        first batches before any sample arrives). Not where the order needs the other
        ranks' holdings (a collective call)."""
        self._stop_tier_ahead(wait=False)
        if (not self.budget or self._shard_of is None or not self._tiered()
                or (self.locality and self.world_size > 1 and self._held_by is None)):
            return
        order = self.order()
        self._stage(order)
        chain = self._files.store.chain
        if chain.room_left() < self.budget:
            # the tiers cannot keep what it would read (the stream, staging the shards in
            # order of first use, takes their room): its reads would be read again by the
            # workers (a tier of a tenth of the dataset: the first epoch read 1.6 D)
            return
        assert self._file_shards is not None
        self.tier_ahead = TierAhead(_tier_reader(self._files, self._file_shards),
                                    self._files.sizes(), self._in_files(order), self.budget,
                                    threads=1,
                                    room=lambda: not chain.full).start()
        self._files._add_tier_ahead(self.tier_ahead)

    def _stop_tier_ahead(self, *, wait: bool) -> None:
        """``wait``: until its reads under way have ended (else they end on their own)."""
        if self.tier_ahead is not None:
            self.tier_ahead.close(wait=wait)
            self.tier_ahead = None

    def _tiered(self) -> bool:
        return getattr(getattr(self._files, "store", None), "chain", None) is not None

    def _in_files(self, order: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Indices of the sampler's dataset as the FileDataset's (through its Subsets)."""
        return order if self._index is None else self._index[order]

    def _tell_workers(self) -> None:
        """Give the dataset this epoch's order before the DataLoader starts its workers (they
        inherit or unpickle it) so each worker can read its own next batches ahead. A
        closed-mode Sampler takes back the plan an earlier Sampler of the dataset gave it:
        with the same seed its workers read ahead in that order, the seed's, which the
        rules forbid, and stops the read into the tiers one started (another Sampler
        leaves them: a validation Subset's sampler would take the training sampler's
        read-ahead away)."""
        if not hasattr(self._files, "_set_upcoming"):
            return
        if self.closed:
            self._files._set_upcoming(None)
            self._files._stop_tier_aheads()  # an earlier Sampler's, in its seed's order
        elif self.budget and not self._tiered():
            plan = self.plan()
            # the next epochs start from their beginning with this world size and these
            # holders, a resumed epoch's too: a persistent worker follows them after it
            # (a resume with another world size turned it off for the rest of the run)
            follow = EpochPlan(self.n, self.seed, self.shuffle, self.drop_last,
                               self.world_size, self.rank, plan.segments[-1].holders,
                               self.window, self._index)
            # the plan, not the order, travels to spawned workers (Upcoming); forked ones
            # inherit the order worked out here
            self._files._set_upcoming(Upcoming(
                self.budget, max(1, self._ahead_threads()[0] // 2), self.epoch, follow,
                tuple(plan.segments), known=self._in_files(self.order())))

    # -- resumable state -------------------------------------------------------------------

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Where this epoch stands, to resume from with ``load_state_dict``.

        ``consumed``: samples consumed by the training loop on all ranks together since
        this iteration started (batches_seen * batch_size * world_size). Without it, what
        this sampler has yielded times world_size is used: exact with num_workers=0, ahead
        of the training loop with workers (they fetch a few batches in advance).
        """
        if consumed is not None:
            consumed = _whole(consumed, "consumed")
            if consumed < 0:
                raise ValueError(f"consumed={consumed}: the samples consumed since this "
                                 "iteration started cannot be negative")
        plan, yielded = self._ended or (self.plan(), self._yielded)
        # past the iteration's end is its end: batches_seen * batch_size * world_size
        # overshoots by the last batch when it is a partial one
        k = yielded if consumed is None else min(consumed // self.world_size,
                                                 len(plan.remaining(self.rank)))
        segs = list(plan.segments)
        last = segs[-1]
        segs[-1] = Segment(last.world, last.consumed + k, last.holders)
        return {
            "version": _STATE_VERSION, "n": self.n, "seed": self.seed, "epoch": self.epoch,
            "shuffle": self.shuffle, "drop_last": self.drop_last, "locality": self.locality,
            "window": self.window, "dataset": self._dataset_digest(),
            "segments": [[s.world, s.consumed, None if s.holders is None
                          else [list(h) for h in s.holders]] for s in segs],
        }

    def _dataset_digest(self) -> str | None:
        """Which files the sampler's indices are, in their order: xxh3_64 of their path
        hashes (the manifest's), through the Subsets (None for a dataset that is not a
        stagefs one). The count alone let a state of another dataset of the same size, or
        of a ``random_split`` without a fixed generator (another split each run), resume
        silently: samples read twice and others never."""
        if self._digest is None and self._files is not None:
            hashes = self._files.path_hashes()
            if self._index is not None:
                hashes = hashes[self._index]
            self._digest = f"{checksum(np.ascontiguousarray(hashes).tobytes()):016x}"
        return self._digest

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume mid-epoch: the next iteration yields only what no rank consumed yet.

        The world size (and, with locality, the holdings) may differ from the run that
        saved the state; the remaining samples are then dealt out afresh among the ranks.
        """
        if not isinstance(state, Mapping):
            raise ConfigError(f"a sampler state is the dict state_dict() returned, not "
                              f"{type(state).__name__} ({_short(state)})")
        if state.get("version") != _STATE_VERSION:
            raise ConfigError(f"sampler state version {state.get('version')!r}; this stagefs "
                              f"reads version {_STATE_VERSION}")
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ConfigError(f"sampler state has no {', '.join(missing)}: it is truncated or "
                              "not a stagefs Sampler's state; save it again with state_dict()")
        for key in ("n", "seed", "shuffle", "drop_last", "locality", "window"):
            if state[key] != getattr(self, key) or type(state[key]) is not type(
                    getattr(self, key)):
                raise ConfigError(f"sampler state has {key}={state[key]!r} but this sampler "
                                  f"has {getattr(self, key)!r}: it is another run's state")
        if not isinstance(state.get("dataset"), (str, type(None))):
            raise ConfigError(f"sampler state is damaged (dataset {_short(state['dataset'])}, "
                              "not a digest): save it again with state_dict()")
        here = self._dataset_digest()
        if state.get("dataset") is not None and here is not None and state["dataset"] != here:
            raise ConfigError(
                f"sampler state is of another dataset: the same number of samples ({self.n}) "
                f"but other files (dataset {state['dataset']!r}, this one {here!r}): resume "
                "on the dataset it was saved with; a torch Subset from random_split differs "
                "each run unless it is given a seeded generator (generator=torch.Generator()"
                ".manual_seed(0))")
        epoch, segments = self._check_state(state)
        self.epoch = epoch
        self._segments = segments
        self._plan = None
        self._yielded = 0
        self._ended = None
        self._resumed = True
        self._tell_workers()
        self._read_ahead_early()

    def _check_state(self, state: Mapping[str, Any]) -> tuple[int, list[Segment]]:
        """The epoch and segments of ``state``, checked: whole numbers, one entry per rank
        in a segment's holders, holders exactly with locality; else ConfigError."""

        def damaged(why: str) -> ConfigError:
            return ConfigError(f"sampler state is damaged ({why}; epoch {state['epoch']!r}, "
                               f"segments {_short(state['segments'])}): save it again with "
                               "state_dict()")

        epoch = state["epoch"]
        if not _is_whole(epoch) or epoch < 0:
            raise damaged("the epoch is not a whole number from 0")
        raw = state["segments"]
        if not isinstance(raw, (list, tuple)) or not raw:
            raise damaged("no list of segments")
        segments: list[Segment] = []
        for seg in raw:
            if not isinstance(seg, (list, tuple)) or len(seg) != 3:
                raise damaged("a segment is not [world size, consumed, holders]")
            w, c, h = seg
            if not (_is_whole(w) and _is_whole(c)) or w < 1 or c < 0:
                raise damaged("a segment's world size or consumed count is not a whole "
                              "number (at least 1 and 0)")
            if (h is None) != (not self.locality):
                raise damaged("holders " + ("missing for a locality sampler" if self.locality
                                            else "given without locality"))
            holders = None
            if h is not None:
                if not isinstance(h, (list, tuple)) or len(h) != w or not all(
                        isinstance(x, (list, tuple)) and all(_is_whole(v) for v in x)
                        for x in h):
                    raise damaged(f"holders are not {w} lists of shard numbers")
                holders = tuple(tuple(int(v) for v in x) for x in h)
            segments.append(Segment(int(w), int(c), holders))
        return int(epoch), segments

    def __repr__(self) -> str:
        return (f"<stagefs.torch.Sampler rank {self.rank}/{self.world_size} epoch {self.epoch}"
                f" seed {self.seed}{' locality' if self.locality else ''}>")

    def close(self) -> None:
        self._stop_tier_ahead(wait=True)
        if self.prefetcher is not None:
            self.prefetcher.close()
            self._files._set_prefetcher(None)
            self.prefetcher = None

    def __del__(self) -> None:
        for p in (getattr(self, "prefetcher", None), getattr(self, "tier_ahead", None)):
            if p is not None and p.pid == os.getpid():
                p.close()
