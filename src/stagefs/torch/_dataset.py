"""FileDataset: a map-style dataset of the files under one directory of a Store, laid out as
torchvision's ImageFolder expects (one folder per class)."""

from __future__ import annotations

import logging
import math
import operator
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch.utils.data

from stagefs._sampling import Plan, Segment
from stagefs.errors import ConfigError, NotFoundError
from stagefs.format import KIND_DIR, KIND_FILE, KIND_SYMLINK
from stagefs.store import Store
from stagefs.store import open as open_store
from stagefs.torch._prefetch import Prefetcher, TierAhead

__all__ = ["FileDataset"]

Target = Literal["folder", "path"] | None
log = logging.getLogger("stagefs")


@dataclass(frozen=True, slots=True)
class EpochPlan:
    """How the Sampler deals an epoch from its start: enough for a worker to work out the
    order of the epoch after the one it was told of (persistent workers keep their copy of
    the dataset, so set_epoch cannot reach them)."""

    n: int
    seed: int
    shuffle: bool
    drop_last: bool
    world: int
    rank: int
    holders: tuple[tuple[int, ...], ...] | None
    window: int
    # the sampler's dataset is a Subset of this one (random_split): its samples here, by
    # the sampler's index; the order is dealt over the Subset and read here
    index: npt.NDArray[np.int64] | None = None

    def order(self, epoch: int, shard_of: Callable[[], npt.NDArray[np.int64]],
              segments: Sequence[Segment] | None = None) -> npt.NDArray[np.int64]:
        """This rank's order of ``epoch`` (by this dataset's indices): from its start, or,
        given the epoch's ``segments`` (a resumed epoch), from where the last one stands.
        ``shard_of`` is called only for a locality plan, which needs it."""
        segs = list(segments) if segments else [Segment(self.world, 0, self.holders)]
        local = any(s.holders is not None for s in segs)
        shards = shard_of() if local else None
        if shards is not None and self.index is not None:
            shards = shards[self.index]
        order = Plan(self.n, self.seed, epoch, self.shuffle, self.drop_last, segs, shards,
                     self.window).remaining(self.rank)
        return order if self.index is None else self.index[order]


@dataclass(slots=True)
class Upcoming:
    """What the Sampler tells DataLoader workers: how this rank's order of the epoch is
    dealt, and the read-ahead budget (shared by the workers) and threads (per worker).

    The order itself (8 bytes a sample) is not pickled: a spawned worker works it out
    from the plan (a function of numbers) when it first reads. Sent along, it was
    10 MB per worker for ImageNet's 1.28 M files, more than a pipe holds, so the
    DataLoader could start the next worker only once this one had imported torch and
    read it: the workers started one after the other. A forked worker inherits the
    order the Sampler worked out."""

    budget: int
    threads: int
    epoch: int
    plan: EpochPlan  # also to follow into the next epochs
    segments: tuple[Segment, ...] | None = None  # a resumed epoch's stretches; None: its start
    known: npt.NDArray[np.int64] | None = None  # the order, once worked out in this process

    def order(self, shard_of: Callable[[], npt.NDArray[np.int64]]) -> npt.NDArray[np.int64]:
        if self.known is None:
            self.known = self.plan.order(self.epoch, shard_of, self.segments)
        return self.known

    def __getstate__(self) -> dict[str, Any]:
        return {"budget": self.budget, "threads": self.threads, "epoch": self.epoch,
                "plan": self.plan, "segments": self.segments}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        self.known = None


@dataclass
class _WorkerAhead:
    """A worker's read-ahead: its own future batches, as the DataLoader deals them out."""

    pid: int
    prefetcher: Prefetcher
    batches: list[npt.NDArray[np.int64]]
    next: int = 0


class FileDataset(torch.utils.data.Dataset[Any]):
    """The files under ``root`` of a dataset, one class per sub-folder (sorted by name).

    ``store_or_path``: a ``Store`` (from ``stagefs.open``) or the path to open. An item is
    ``(sample, target)``: ``sample`` is ``transform(bytes)`` (the raw bytes without a
    transform); ``target`` is the class index (``target="folder"``), the file's path in the
    dataset (``"path"``), or nothing (``None``: the item is the sample alone).
    ``classes``, ``class_to_idx`` and ``targets`` are ImageFolder's (``targets`` as a numpy
    array). ``extensions``: keep only files ending so (case-insensitive), as ImageFolder.

    Each process holds only numpy arrays of entry numbers into the memory-mapped manifest;
    pickling (to spawned workers) sends the store's path and these arguments, not the arrays.
    """

    def __init__(
        self,
        store_or_path: Store | str | os.PathLike[str],
        root: str = "train",
        transform: Callable[[bytes], Any] | None = None,
        target: Target = "folder",
        *,
        target_transform: Callable[[Any], Any] | None = None,
        extensions: str | Sequence[str] | None = None,
    ) -> None:
        if target not in ("folder", "path", None):
            raise ConfigError(f"target={target!r}: use 'folder', 'path' or None")
        self.store = (store_or_path if isinstance(store_or_path, Store)
                      else open_store(store_or_path))
        self.root = root.strip("/")
        self.transform, self.target_transform = transform, target_transform
        self.target: Target = target
        if isinstance(extensions, (str, bytes)):  # one extension, as ImageFolder takes it
            extensions = (os.fsdecode(extensions),)
        self.extensions = tuple(e.lower() for e in extensions) if extensions else None
        self._prefetcher: Prefetcher | None = None
        # the reads into the tiers Samplers of this dataset run (one each, while it runs)
        self._tier_aheads: weakref.WeakSet[TierAhead] = weakref.WeakSet()
        self._upcoming: Upcoming | None = None
        self._worker_ahead: _WorkerAhead | None = None
        self._scan()

    # -- the listing -----------------------------------------------------------------------

    def _scan(self) -> None:
        ns, m = self.store.namespace, self.store.manifest
        try:
            top = ns.dir_entry(self.root)
        except FileNotFoundError:
            raise NotFoundError(self.root, f"No such directory in {self.store.pack_dir} "
                                "(FileDataset's root)") from None
        kinds = m.arrays["kind"]
        # ImageFolder's classes: the sub-folders of root, symlinks to folders included
        class_dirs = [c for c in m.children(top) if ns.kind_of(c) == KIND_DIR]
        class_dirs.sort(key=lambda c: os.fsdecode(m.name_of(c)))  # as str, as ImageFolder
        self.classes: list[str] = [os.fsdecode(m.name_of(c)) for c in class_dirs]
        self.class_to_idx: dict[str, int] = {c: i for i, c in enumerate(self.classes)}
        parts: list[npt.NDArray[np.int64]] = []
        labels: list[npt.NDArray[np.int64]] = []
        # the dataset path of a sample reached through a symlink (the link's path, as
        # ImageFolder gives it), by sample index; none in a tree without symlinks
        self._link_paths: dict[int, str] = {}
        top_path = m.path_of(top)
        base = top_path + b"/" if top_path else b""
        at = 0
        for label, c in enumerate(class_dirs):
            files, links = self._files_under(ns.follow(c, self.classes[label]),
                                             base + m.name_of(c), kinds)
            self._link_paths.update((at + k, p) for k, p in links.items())
            at += len(files)
            parts.append(files)
            labels.append(np.full(len(files), label, dtype=np.int64))
        self.entries: npt.NDArray[np.int64] = (np.concatenate(parts) if parts
                                               else np.zeros(0, np.int64))
        self.targets: npt.NDArray[np.int64] = (np.concatenate(labels) if labels
                                               else np.zeros(0, np.int64))
        if not self.classes:
            raise NotFoundError(self.root, f"No class folders under it in "
                                f"{self.store.pack_dir} (FileDataset wants ROOT/CLASS/FILE)")
        if not len(self.entries):
            raise NotFoundError(self.root, "No files in its class folders"
                                + (f" ending with {self.extensions}" if self.extensions else ""))

    def _files_under(self, d: int, path: bytes, kinds: npt.NDArray[Any]
                     ) -> tuple[npt.NDArray[np.int64], dict[int, str]]:
        """Files below directory entry ``d`` (dataset path ``path``), in ImageFolder's order:
        ``sorted(os.walk(d, followlinks=True))``, each folder's files sorted by name, a
        symlink listed by its own name and path. A symlink to a folder that holds it (a
        loop, which os.walk would follow until the path is too long) is not followed.
        (The files' entries, {position: dataset path} for files reached through a link.)"""
        ns, m = self.store.namespace, self.store.manifest
        found: list[tuple[bytes, npt.NDArray[np.int64], dict[int, bytes]]] = []
        stack: list[tuple[int, bytes, frozenset[int]]] = [(d, path, frozenset((d,)))]
        while stack:
            cur, cur_path, above = stack.pop()
            r = m.children(cur)
            k = kinds[r.start : r.stop]
            files = r.start + np.flatnonzero(k == KIND_FILE).astype(np.int64)
            names: list[bytes] | None = None
            linked: dict[int, bytes] = {}  # position in files -> the link's path
            sym = r.start + np.flatnonzero(k == KIND_SYMLINK)
            if len(sym):  # files and links to files, sorted by name (as os.walk lists them)
                rows = [(m.name_of(int(e)), int(e), False) for e in files]
                for e in sym.tolist():
                    kind = ns.kind_of(e)
                    if kind == KIND_FILE:
                        rows.append((m.name_of(e), ns.follow(e, m.path_of(e)), True))
                    elif kind == KIND_DIR:
                        self._push_link(e, cur_path, above, stack)
                rows.sort(key=lambda t: os.fsdecode(t[0]))
                names = [t[0] for t in rows]
                files = np.asarray([t[1] for t in rows], dtype=np.int64)
                linked = {i: cur_path + b"/" + t[0] for i, t in enumerate(rows) if t[2]}
            elif len(files) > 1 and not _utf8(m, r):
                listed = [m.name_of(int(e)) for e in files]
                order = sorted(range(len(listed)), key=lambda i: os.fsdecode(listed[i]))
                names = [listed[i] for i in order]
                files = files[order]
            stack.extend((int(e), cur_path + b"/" + m.name_of(int(e)), above | {int(e)})
                         for e in r.start + np.flatnonzero(k == KIND_DIR))
            if self.extensions and len(files):  # on the name listed (a link's own name)
                if names is None:
                    names = [m.name_of(int(e)) for e in files]
                keep = [os.fsdecode(n).lower().endswith(self.extensions) for n in names]
                kept = np.flatnonzero(np.asarray(keep, dtype=bool))
                files = files[kept]
                linked = {j: linked[i] for j, i in enumerate(kept.tolist()) if i in linked}
            if len(files) and cur_path != m.path_of(cur):  # a folder reached through a link
                linked = {i: cur_path + b"/" + m.name_of(int(e)) for i, e in enumerate(files)}
            found.append((cur_path, files, linked))
        found.sort(key=lambda t: os.fsdecode(t[0]))
        out: list[npt.NDArray[np.int64]] = []
        links: dict[int, str] = {}
        at = 0
        for _, files, linked in found:
            links.update((at + i, os.fsdecode(p)) for i, p in linked.items())
            at += len(files)
            out.append(files)
        return np.concatenate(out).astype(np.int64), links

    def _push_link(self, e: int, cur_path: bytes, above: frozenset[int],
                   stack: list[tuple[int, bytes, frozenset[int]]]) -> None:
        """Walk the folder symlink ``e`` leads to, under the link's own path; not one that
        holds the link (a loop): said once, then left out."""
        ns, m = self.store.namespace, self.store.manifest
        target = ns.follow(e, m.path_of(e))
        link_path = cur_path + b"/" + m.name_of(e)
        if target in above:
            log.warning("FileDataset: %s is a symlink to a folder that holds it (a loop): "
                        "not followed", os.fsdecode(link_path))
            return
        stack.append((target, link_path, above | {target}))

    def path_of(self, i: int) -> str:
        """Sample ``i``'s path in the dataset (a symlink's own path, for a file reached
        through one, as ImageFolder gives it)."""
        linked = self._link_paths.get(int(i)) if self._link_paths else None
        if linked is not None:
            return linked
        return os.fsdecode(self._manifest().path_of(int(self.entries[i])))

    def _manifest(self) -> Any:
        """The store's manifest; a clear error once the store is closed (its arrays are let
        go of)."""
        if getattr(self.store, "_closed", False):
            how = getattr(self.store, "_opened_with", lambda: "stagefs.open")()
            raise ValueError(f"I/O operation on a closed Store ({self.store.pack_dir}): this "
                             "FileDataset's store was closed; open the dataset again with "
                             f"{how} and make a new FileDataset")
        return self.store.manifest

    @property
    def samples(self) -> list[tuple[str, int]]:
        """ImageFolder's ``samples``: (path, class index) for every sample, built when first
        asked for and kept (not pickled): ImageFolder's code reads ``ds.samples[i]`` in a
        loop, and building the list at each look made that loop quadratic (50,000 looks
        into 300,000 samples ran for hours)."""
        self._manifest()  # a closed store says so, as before
        built: list[tuple[str, int]] | None = self.__dict__.get("_samples")
        if built is None:
            built = [(self.path_of(i), int(t)) for i, t in enumerate(self.targets)]
            self._samples = built
        return built

    def shard_of(self) -> npt.NDArray[np.int64]:
        """The shard holding each sample."""
        return np.asarray(self._manifest().arrays["shard"][self.entries], dtype=np.int64)

    def sizes(self) -> npt.NDArray[np.int64]:
        """Each sample's size in bytes."""
        return np.asarray(self._manifest().arrays["size"][self.entries], dtype=np.int64)

    def path_hashes(self) -> npt.NDArray[np.uint64]:
        """Each sample's path hash (the manifest's xxh3_64 of the path its bytes are stored
        under): which files the samples are, whatever their bytes (a Sampler's state
        carries a digest of them)."""
        return np.asarray(self._manifest().arrays["hash"][self.entries], dtype=np.uint64)

    # -- items -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.entries)

    def read_samples(self, indices: Sequence[int], *, count: bool = True) -> list[bytes]:
        """The bytes of samples ``indices``, in one batched read (Store.read_entries: the
        entries are known, no path is looked up again); ``count=False``: not counted as
        samples read (a read-ahead into the tiers)."""
        return self.store.read_entries(self.entries[np.asarray(indices, dtype=np.int64)],
                                       count=count)

    def _read_ahead(self, indices: Sequence[int]) -> tuple[list[bytes], Callable[[], None]]:
        """``read_samples`` for a Prefetcher: the bytes, and their count for when it hands
        the first of them out (``Store.read_ahead``)."""
        return self.store.read_ahead(self.entries[np.asarray(indices, dtype=np.int64)])

    def _item(self, i: int, data: bytes) -> Any:
        sample = self.transform(data) if self.transform is not None else data
        if self.target is None:
            return sample
        t: Any = int(self.targets[i]) if self.target == "folder" else self.path_of(i)
        if self.target_transform is not None:
            t = self.target_transform(t)
        return sample, t

    def _ahead(self, first: int) -> Prefetcher | None:
        """The Sampler's read-ahead in this process, for a read that starts with sample
        ``first``: started by the loop's first read (``first`` is the order's next sample),
        else None. Any other read (a sample looked at in the main process while DataLoader
        workers read the epoch) starts none: it would read the epoch up to the budget in
        the main process, whose loop it slows, and count samples never delivered."""
        p = self._prefetcher
        if p is None or p.pid != os.getpid():  # a forked copy: its threads are not here
            return None
        return p.start() if p.started or p.follows(first) else None

    def __getitem__(self, i: int) -> Any:
        i = _index(i, len(self.entries))
        p = self._ahead(i)
        data = p.take(i) if p is not None else None
        if data is None:
            data = self.store.read_entry(int(self.entries[i]))
        return self._item(i, data)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """A batch in one call (the DataLoader's batched fetch): one Store.read_entries."""
        idx = [_index(i, len(self.entries)) for i in indices]
        p = (self._ahead(idx[0]) if idx else None) or self._ahead_in_worker(idx)
        got: list[bytes | None] = [p.take(i) for i in idx] if p is not None else [None] * len(idx)
        missing = [k for k, d in enumerate(got) if d is None]
        if missing:
            for k, d in zip(missing, self.read_samples([idx[k] for k in missing]), strict=True):
                got[k] = d
        return [self._item(i, d) for i, d in zip(idx, got, strict=True)]  # type: ignore[arg-type]

    def _ahead_in_worker(self, idx: list[int]) -> Prefetcher | None:
        """In a DataLoader worker: read ahead the batches this worker will be given.

        The DataLoader hands batch b to worker b mod num_workers (round robin, in order), so
        from the rank's order a worker knows its own future batches. Any batch that is not
        the one expected (another batch sampler, a stale order in a persistent worker after
        the first epoch) turns the read-ahead off in this worker: reads are then direct.
        """
        up = self._upcoming
        if up is None or not idx:
            return None
        info = torch.utils.data.get_worker_info()
        if info is None:
            return None
        st = self._worker_ahead
        if st is None or st.pid != os.getpid():
            st = self._worker_ahead = self._worker_plan(up, info, len(idx))
        if st.next >= len(st.batches) or st.batches[st.next].tolist() != idx:
            st.prefetcher.close()
            self._upcoming = self._worker_ahead = None
            nxt = self._next_epoch(up)
            if nxt is None:
                return None
            st = self._worker_plan(nxt, info, len(idx))
            if not st.batches or st.batches[0].tolist() != idx:
                st.prefetcher.close()
                return None
            self._upcoming, self._worker_ahead = nxt, st
        st.next += 1
        return st.prefetcher.start()

    def _worker_plan(self, up: Upcoming, info: Any, size: int) -> _WorkerAhead:
        order = up.order(self.shard_of)
        n = len(order)
        batches = [order[b * size : (b + 1) * size]
                   for b in range(info.id, math.ceil(n / size), info.num_workers)]
        mine = np.concatenate(batches) if batches else order[:0]
        p = Prefetcher(self._read_ahead, self.sizes(), mine,
                       max(1, up.budget // info.num_workers), threads=up.threads)
        return _WorkerAhead(os.getpid(), p, batches)

    def _next_epoch(self, up: Upcoming) -> Upcoming | None:
        """A persistent worker's batches stopped matching: if they are the next epoch's,
        follow it (the order is a function of the seed and the epoch)."""
        return Upcoming(up.budget, up.threads, up.epoch + 1, up.plan)

    def _set_upcoming(self, up: Upcoming | None) -> None:
        self._upcoming = up

    def _set_prefetcher(self, p: Prefetcher | None) -> None:
        old, self._prefetcher = self._prefetcher, p
        if old is not None and old is not p and old.pid == os.getpid():
            old.close()

    def _add_tier_ahead(self, t: TierAhead) -> None:
        """A Sampler's read into the tiers for this dataset, known here so that a closed-mode
        Sampler of it can stop it (``_stop_tier_aheads``): it reads in its Sampler's order."""
        self._tier_aheads.add(t)

    def _stop_tier_aheads(self) -> None:
        for t in list(self._tier_aheads):
            if t.pid == os.getpid():
                t.close(wait=False)
        self._tier_aheads = weakref.WeakSet()

    # -- pickling: the store reopens by path; the listing is rebuilt from the shared mmap ---

    def __getstate__(self) -> dict[str, Any]:
        return {"store": self.store, "root": self.root, "transform": self.transform,
                "target": self.target, "target_transform": self.target_transform,
                "extensions": self.extensions, "_upcoming": self._upcoming}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._prefetcher = None
        self._tier_aheads = weakref.WeakSet()
        self._worker_ahead = None
        self._scan()

    def __repr__(self) -> str:
        return (f"<stagefs.torch.FileDataset {self.store.pack_dir!r} root={self.root!r}: "
                f"{len(self.entries)} files, {len(self.classes)} classes>")


def _utf8(m: Any, children: range) -> bool:
    """Whether the paths of ``children`` are all UTF-8: then their order in the manifest (by
    bytes) is their order as str, ImageFolder's (UTF-8 keeps the order of code points). A
    byte that is not UTF-8 becomes a surrogate (U+DC80-U+DCFF) in a str, which sorts after
    most characters: such a folder is sorted again by its names as str."""
    off = m.arrays["path_off"]
    block = m.strings[int(off[children.start]) : int(off[children.stop])].tobytes()
    if block.isascii():
        return True
    try:
        block.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _index(i: Any, n: int) -> int:
    """Sample ``i`` of ``n``: a whole number (numpy's and torch's included, negative from
    the end), as a list's index; a float or a string is a TypeError, not truncated."""
    try:
        k = operator.index(i)
    except TypeError:
        raise TypeError(f"sample indices are whole numbers, not {type(i).__name__} "
                        f"({i!r})") from None
    if k < 0:
        k += n
    if not 0 <= k < n:
        raise IndexError(f"sample index {i} out of range (the dataset has {n})")
    return k
