"""Partial caching in pieces (tiers/fill.py, tiers/chain.py; docs/decisions/0015-pieces.md):
with dataset D and tiers of total capacity C < D, later epochs read D - C from the origin,
the held set stays put, and a tier smaller than a shard still holds its share."""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stagefs
from conftest import flip_byte, pack_files, random_bytes
from stagefs.tiers.tier import dir_bytes

SAMPLE = 100_000
PIECE = 256 * 1024  # the unit of placement in the first test
N = 480  # 48 MB of incompressible samples, in 6 shards of 8 MiB (8 pieces of 1 MiB each)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    base = tmp_path_factory.mktemp("pieces")
    files = {f"d{i % 7}/s{i:04d}.jpg": random_bytes(SAMPLE + i, i) for i in range(N)}
    return pack_files(base, "raw", files), files


def epoch(fs: stagefs.Store, files: dict[str, bytes], seed: int) -> int:
    """Read every file once in a random order; the origin bytes it took."""
    paths = sorted(files)
    random.Random(seed).shuffle(paths)
    before = fs.origin.stats.bytes_read
    for p in paths:
        assert fs.read(p) == files[p], p
    assert fs.chain is not None
    fs.chain.wait_idle(60)
    return int(fs.origin.stats.bytes_read - before)


def data_bytes(fs: stagefs.Store) -> int:
    m = fs.manifest
    return int(sum(int(m.stored[e]) for e in range(len(m)) if m.kind[e] == 0 and m.stored[e]))


@pytest.mark.parametrize("share", [0.5, 0.25])
def test_later_epochs_read_what_does_not_fit(dataset: tuple[Path, dict[str, bytes]],
                                             runtime: Path, tmp_path: Path, share: float,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Two tiers, the first (the RAM tier) smaller than one shard: together they hold
    ``share`` of the dataset; epochs 2 and 3 read D - C from the origin (within 5%), the
    pieces held after epoch 2 are the pieces held after epoch 3, and each tier holds
    pieces, never more than its capacity.

    Pieces of 256 KiB (a quarter of the checksum piece, so aligned with it): a tier leaves
    unused less than one piece of its capacity, which is 2-4% of this small dataset at
    1 MiB (at the scale of real tiers, under 0.5%)."""
    from stagefs.tiers import chain as chain_mod

    monkeypatch.setattr(chain_mod, "PIECE_SIZE", PIECE)
    pack, files = dataset
    with stagefs.open(pack) as probe:
        d = data_bytes(probe)
        shard = max(s.size for s in probe.manifest.shards)
    cap = int(d * share)
    ram = 3 * 2**20  # below one shard (8 MiB): it held nothing when shards were the unit
    assert ram < shard
    tiers = [f"{tmp_path / 'ram'}:{ram}", f"{tmp_path / 'disk'}:{cap - ram}"]
    with stagefs.open(pack, tiers=tiers) as fs:
        assert fs.chain is not None
        assert fs.chain.origin is fs.origin
        spans: list[tuple[int, int, int]] = []
        pread, through = fs.origin.pread, fs.origin.pread_through

        inside = threading.local()  # pread_through may hand a read to pread: once

        def counting(read: Any) -> Any:
            def counted(shard: int, offset: int, length: int, **kw: Any) -> bytes:
                if getattr(inside, "read", False):
                    return read(shard, offset, length, **kw)
                spans.append((shard, offset, offset + length))
                inside.read = True
                try:
                    return read(shard, offset, length, **kw)
                finally:
                    inside.read = False
            return counted

        monkeypatch.setattr(fs.origin, "pread", counting(pread))
        monkeypatch.setattr(fs.origin, "pread_through", counting(through))  # the streams'
        epoch(fs, files, 1)
        monkeypatch.setattr(fs.origin, "pread", pread)
        monkeypatch.setattr(fs.origin, "pread_through", through)
        # the first epoch reads each byte once: no two origin reads overlap (a read racing
        # a stream that makes its shard whole once went to the origin for bytes the tier
        # had); the streams' runs take the padding between files too, nothing more
        spans.sort()
        for (s1, _a1, b1), (s2, a2, _b2) in itertools.pairwise(spans):
            assert s1 != s2 or a2 >= b1, (s1, a2, b1)
        assert d <= sum(b - a for _, a, b in spans) <= sum(s.size for s in fs.manifest.shards)
        second = epoch(fs, files, 2)
        held2 = fs.chain.held_pieces()
        third = epoch(fs, files, 3)
        held3 = fs.chain.held_pieces()
        for got in (second, third):
            assert abs(got - (d - cap)) <= 0.05 * (d - cap), (got, d - cap)
        assert held2 == held3  # no thrash: the held set stays put
        ram_t, disk_t = fs.chain.tiers
        assert held2[ram_t.root] and held2[disk_t.root]  # the RAM tier holds its share
        assert not held2[ram_t.root] & held2[disk_t.root]  # a piece is in one tier
        assert ram_t.used_bytes() <= ram and disk_t.used_bytes() <= cap - ram
        # what their file systems allocate too (whole blocks: counted by the bytes of the
        # pieces alone, a tier went over by the blocks their ends share)
        assert dir_bytes(ram_t.root) <= ram and dir_bytes(disk_t.root) <= cap - ram
        assert ram - dir_bytes(ram_t.root) < 2 * PIECE  # and full to within a piece
        # a shard the stream reached while a tier had room for all of it is whole there; the
        # rest of the room went to pieces, read ones first: shards held in part
        in_part = {s for s, _ in held2[ram_t.root] | held2[disk_t.root]} - fs.held_shards()
        assert in_part


def test_the_list_of_a_shards_copies_a_reader_holds_is_never_changed_under_it(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path) -> None:
    """A read looks up which partial copy holds a piece without the lock (``_owner``). The
    shard's list was sorted in place as a copy was made in another tier (CPython's sort
    leaves a list empty while it runs), and popped then set again as a copy was let go of:
    a read between found no copy of the shard (the tiers full: "no tier has room for its
    piece") and read from the origin bytes a stream was bringing into the other copy (an
    origin byte read twice in epoch 1, about one run in twenty of the test above). Each
    change sets a new list now: the one a reader holds stays as it was."""
    pack, _files = dataset
    with stagefs.open(pack, tiers=[str(tmp_path / "a"), str(tmp_path / "b")]) as fs:
        chain = fs.chain
        assert chain is not None
        a, b = chain.tiers
        with chain._tier_lock(), chain._fills_lock:
            chain._make_copy(0, b, 0)
        seen = chain._fills[0]
        was = list(seen)
        with chain._tier_lock(), chain._fills_lock:
            chain._make_copy(0, a, 0)  # the first tier's: sorted before b's
        assert seen == was
        now = chain._fills[0]
        assert [t for _, t in now] == [a, b]
        chain._forget_fill(0, a)
        assert [t for _, t in now] == [a, b] and [t for _, t in chain._fills[0]] == [b]
        assert now[0][0].closed and not chain._fills[0][0][0].closed


@pytest.mark.parametrize(("size", "share"), [(20_000, 0.5), (20_000, 0.25), (100_000, 0.5)])
def test_a_small_dataset_reads_what_its_tier_cannot_hold(
        runtime: Path, tmp_path: Path, size: int, share: float) -> None:
    """A dataset of a few MB (a test's, a small validation set) and a tier of a share of
    it, the placement pieces left as they are: epochs 2 and 3 read D - C from the origin
    within 5%, and the tier holds its share (at least all but a piece of it). With 1 MiB
    pieces, a 2 MB tier of a 4 MB dataset held one piece, and later epochs read 47% more
    than D - C. (D - C is 30 files or more here: a tier holds whole files, so the error is
    up to a file.)"""
    from stagefs.tiers.fill import placement_piece, usual_piece

    n = 6_000_000 // size
    files = {f"d{i % 3}/f{i:04d}.bin": random_bytes(size, 7 * i + size) for i in range(n)}
    pack = pack_files(tmp_path, "small", files)
    with stagefs.open(pack) as probe:
        d = data_bytes(probe)
        window = placement_piece(probe.manifest)
        assert window < probe.manifest.piece_size
        usual = usual_piece(probe.manifest, window)
    cap = int(d * share)
    with stagefs.open(pack, tiers=[f"{tmp_path / 'ram'}:{cap}"]) as fs:
        assert fs.chain is not None
        epoch(fs, files, 1)
        later = [epoch(fs, files, 2), epoch(fs, files, 3)]
        for got in later:
            assert abs(got - (d - cap)) <= 0.05 * (d - cap), (got, d - cap, later)
        used = fs.chain.tiers[0].used_bytes()
        assert cap - usual - 8192 <= used <= cap  # short of it by a piece at most


def test_a_tier_smaller_than_a_shard_serves_its_pieces(dataset: tuple[Path, dict[str, bytes]],
                                                       runtime: Path, tmp_path: Path) -> None:
    """One tier of 2 MiB (a quarter of a shard): reads of what it holds never go to the
    origin, in this process and in another one."""
    pack, files = dataset
    tier = f"{tmp_path / 'ram'}:{2 * 2**20}"
    with stagefs.open(pack, tiers=[tier]) as fs:
        assert fs.chain is not None
        epoch(fs, files, 4)
        held = fs.chain.held_pieces()[fs.chain.tiers[0].root]
        # its share: what it holds is within its capacity, short of it by about a piece
        held_bytes = sum(int(fs.chain._extents_of(s).sizes()[p]) for s, p in held)
        assert 2 * 2**20 - 4 * SAMPLE <= held_bytes <= 2 * 2**20
    with stagefs.open(pack, tiers=[tier]) as fs:
        assert fs.chain is not None
        m = fs.manifest
        in_held = []
        for p in sorted(files):
            e = m.lookup(p.encode())
            ext = fs.chain._extents_of(int(m.shard[e]))
            if (int(m.shard[e]), int(ext.piece[ext.at(int(m.offset[e]))])) in held:
                in_held.append(p)
        assert len(in_held) >= 8
        before = fs.origin.stats.bytes_read
        for p in in_held:
            assert fs.read(p) == files[p]
        assert fs.origin.stats.bytes_read == before
        assert fs.chain.tiers[0].stats.hits == len(in_held)


def test_a_tier_with_room_makes_shards_whole(dataset: tuple[Path, dict[str, bytes]],
                                             runtime: Path, tmp_path: Path) -> None:
    """With room for everything, pieces add up to whole copies, renamed into place and read
    through their own fd, as before pieces."""
    pack, files = dataset
    with stagefs.open(pack, tiers=[str(tmp_path / "t")]) as fs:
        assert fs.chain is not None
        epoch(fs, files, 5)
        assert fs.held_shards() == set(range(len(fs.manifest.shards)))
        assert epoch(fs, files, 6) == 0
        assert not list((tmp_path / "t").rglob("*.partial"))


def test_the_stream_places_pieces_when_the_tiers_are_smaller_than_a_shard(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path) -> None:
    """Two tiers of 3 MiB each, both smaller than a shard (8 MiB): the stream given a shard
    reserves its pieces in tier order and reads from the origin only the files of the
    pieces it placed; a read of that shard then asks the partial copies of both tiers, in
    tier order, before the stream and the origin, and only the rest comes from the origin."""
    pack, files = dataset
    tiers = [f"{tmp_path / 'ram'}:{3 * 2**20}", f"{tmp_path / 'disk'}:{3 * 2**20}"]
    with stagefs.open(pack, tiers=tiers) as fs:
        chain = fs.chain
        assert chain is not None
        m = fs.manifest
        shard = 0
        chain.prefetch([shard])
        assert chain.wait_idle(60)
        held = chain.held_pieces()
        ram_t, disk_t = chain.tiers
        in_ram, in_disk = held[ram_t.root], held[disk_t.root]
        assert in_ram and in_disk and not in_ram & in_disk
        assert {s for s, _ in in_ram | in_disk} == {shard}
        ext = chain._extents_of(shard)
        pieces = sorted(p for _, p in in_ram | in_disk)
        # in piece order, the first tier first; a piece larger than a tier's room is passed
        # over while a piece still fits there, and the smaller ones after it placed
        assert pieces[: 2] == [0, 1] and len(pieces) >= 4
        assert max(p for _, p in in_ram) < min(p for _, p in in_disk)
        files_in = np.isin(ext.piece, pieces)
        placed = int((ext.ends - ext.offs)[files_in].sum())
        first = fs.origin.stats.bytes_read
        # the stream read the files it placed, once, in runs (with the alignment padding
        # between them), and nothing past the last piece it placed
        assert placed <= first <= ext.span(pieces[-1])[1] - ext.span(0)[0] < m.shards[shard].size
        assert fs.held_shards() == set()
        hs = chain.holders(shard)
        assert hs == (chain._fill_src[id(ram_t)], chain._fill_src[id(disk_t)],
                      chain.stream.source, fs.origin)
        mine = [p for p in sorted(files) if int(m.shard[m.lookup(p.encode())]) == shard]
        for p in mine:
            assert fs.read(p) == files[p]
        total = sum(int(m.stored[m.lookup(p.encode())]) for p in mine)
        # the rest came over once, read by its readers
        assert fs.origin.stats.bytes_read - first == total - placed
        assert ram_t.stats.hits + disk_t.stats.hits >= len(in_ram | in_disk)


def test_the_stream_serves_a_range_across_the_copies_of_two_tiers(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path) -> None:
    """A range whose pieces lie in two tiers' partial copies (a batch's coalesced run) comes
    from both copies through the stream's holder, byte for byte, with no origin read."""
    pack, _ = dataset
    tiers = [f"{tmp_path / 'ram'}:{3 * 2**20}", f"{tmp_path / 'disk'}:{3 * 2**20}"]
    with stagefs.open(pack, tiers=tiers) as fs:
        chain = fs.chain
        assert chain is not None
        chain.prefetch([0])
        assert chain.wait_idle(60)
        held = chain.held_pieces()
        last_ram = max(p for _, p in held[chain.tiers[0].root])
        ext = chain._extents_of(0)
        a, b = ext.span(last_ram)[0], ext.span(last_ram + 1)[1]  # two pieces, two tiers
        before = fs.origin.stats.bytes_read
        got = chain.stream.source.pread(0, a, b - a)
        assert fs.origin.stats.bytes_read == before
        with open(pack / fs.manifest.shards[0].name, "rb") as f:
            f.seek(a)
            assert got == f.read(b - a)


def test_a_read_racing_the_stream_that_makes_a_shard_whole_reads_the_tier(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiers are full; a stream thread makes a shard whole (it routes the shard, then
    lets its partial copy go) between a reader's look at the routes and its look at the
    partial copies: the reader is sent to the tier, not to the origin (its bytes would come
    over twice: the first epoch read 1% more than the dataset now and then)."""
    pack, _ = dataset
    with stagefs.open(pack) as probe:
        shard_size = max(s.size for s in probe.manifest.shards)
    tier = f"{tmp_path / 't'}:{int(shard_size * 1.5)}"  # one whole shard, no second one
    with stagefs.open(pack, tiers=[tier]) as fs:
        chain = fs.chain
        assert chain is not None
        shard = 0
        chain.prefetch([shard])
        assert chain.wait_idle(60)
        chain.prefetch([1])  # fills the rest of the room: the tiers are full
        assert chain.wait_idle(60)
        assert chain.full and shard in chain._route
        whole = chain._route[shard]

        class Racing(dict):  # type: ignore[type-arg]
            """The reader looks at the route before the stream thread sets it."""

            def get(self, key: object, default: object = None) -> object:
                return None if key == shard else super().get(key, default)

        monkeypatch.setattr(chain, "_route", Racing(chain._route))
        chain._fills.pop(shard, None)  # let go by the stream thread, after the route
        chain._next_check[shard] = float("inf")  # a recent look: not looked at again
        assert chain.holders(shard) == whole


def test_a_large_file_that_does_not_fit_leaves_the_room_to_smaller_pieces(
        runtime: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file larger than a tier's room is one piece that does not fit: read first, it once
    stopped the tier, which then held nothing. Now it is passed over and the smaller pieces
    read after it fill the tier to within a piece, kept from then on: a later epoch reads
    D - C from the origin, within 5%."""
    from stagefs.tiers import chain as chain_mod

    piece = 256 * 1024
    monkeypatch.setattr(chain_mod, "PIECE_SIZE", piece)
    raw = tmp_path / "raw"
    files = {f"s/{i:03d}.bin": random_bytes(60_000 + i, 1000 + i) for i in range(80)}
    files["big/a.bin"] = random_bytes(4 * 2**20, 7)
    for rel, data in files.items():
        (raw / rel).parent.mkdir(parents=True, exist_ok=True)
        (raw / rel).write_bytes(data)
    stagefs.pack(raw, tmp_path / "pack", shard_size="16MiB", jobs=1, progress=False,
                 echo=lambda _m: None)
    cap = 2 * 2**20  # half the large file, two fifths of the small ones
    with stagefs.open(tmp_path / "pack", tiers=[f"{tmp_path / 'ram'}:{cap}"]) as fs:
        assert fs.chain is not None
        d = data_bytes(fs)
        assert fs.read("big/a.bin") == files["big/a.bin"]
        epoch(fs, {p: v for p, v in files.items() if p.startswith("s/")}, 1)
        tier = fs.chain.tiers[0]
        assert cap - 2 * piece <= tier.used_bytes() <= cap
        assert tier.stopped is not None  # full now
        held = fs.chain.held_pieces()
        second = epoch(fs, files, 2)
        assert abs(second - (d - cap)) <= 0.05 * (d - cap), (second, d - cap)
        assert fs.chain.held_pieces() == held


@pytest.fixture(scope="module")
def large_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    """A dataset mostly of files larger than a piece (2-5 MiB, 38 MB in all) and a few
    small ones, in shards of 16 MiB: whole files as the unit of placement left a tier's
    room unused by up to the largest file out."""
    base = tmp_path_factory.mktemp("large")
    files = {f"v/{i:02d}.npy": random_bytes(2 * 2**20 + i * 333_333, 50 + i) for i in range(10)}
    files.update({f"s/{i:02d}.txt": random_bytes(20_000 + i, 90 + i) for i in range(20)})
    for rel, data in files.items():
        p = base / "raw" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    stagefs.pack(base / "raw", base / "pack", shard_size="16MiB", compress="none", jobs=1,
                 progress=False, echo=lambda _m: None)
    return base / "pack", files


@pytest.mark.parametrize("share", [0.25, 0.5, 0.8, 0.9])
def test_large_files_are_placed_in_pieces(large_files: tuple[Path, dict[str, bytes]],
                                          runtime: Path, tmp_path: Path, share: float) -> None:
    """A file larger than a piece is placed by its checksum pieces (fill.Extents): a tier
    of any size fills to within a piece of its capacity, and epochs 2 and 3 read D - C from
    the origin within 5% (or a piece), the held set the same after both; every byte right.
    While a large file was one piece, the room left once the small files were in could be
    smaller than every large file still out."""
    pack, files = large_files
    with stagefs.open(pack) as probe:
        d = data_bytes(probe)
    cap = int(d * share)
    with stagefs.open(pack, tiers=[f"{tmp_path / 't'}:{cap}"]) as fs:
        assert fs.chain is not None
        first = epoch(fs, files, 11)
        assert first <= sum(s.size for s in fs.manifest.shards)
        tier = fs.chain.tiers[0]
        assert cap - 2 * fs.manifest.piece_size <= tier.used_bytes() <= cap
        assert dir_bytes(tier.root) <= cap  # the blocks allocated too
        second = epoch(fs, files, 12)
        held = fs.chain.held_pieces()
        third = epoch(fs, files, 13)
        # within 5%, or a piece where 5% of D - C is less (90%: 180 KB): the room a tier
        # leaves unused is less than one piece
        slack = max(0.05 * (d - cap), fs.manifest.piece_size)
        for got in (second, third):
            assert abs(got - (d - cap)) <= slack, (got, d - cap)
        assert fs.chain.held_pieces() == held


@contextlib.contextmanager
def split_over_two_tiers(pack: Path, name: str, first: Path, second: Path, in_first: int = 2
                         ) -> Iterator[tuple[stagefs.Store, int, int, int]]:
    """A store whose two tiers (at ``first`` and ``second``) hold the first ``in_first`` and
    the rest of the first four of the 5 checksum pieces of file ``name`` (each an extent of
    its own), reserved in them; the last piece in neither. Yields (store, shard, entry,
    piece size)."""
    import mmap

    from stagefs.tiers.fill import Extents, copy_charge
    from stagefs.tiers.placer import Layout

    with stagefs.open(pack) as probe:
        m = probe.manifest
        e = probe.namespace.file_entry(name)
        shard, off, n = int(m.shard[e]), int(m.offset[e]), int(m.size[e])
        lay = Layout(m)
        ext = Extents.of(m, lay.idx[lay.bounds[shard] : lay.bounds[shard + 1]],
                         m.shards[shard].size)
        lo, hi = ext.touching(off, off + n)
        assert hi - lo == 5 and list(ext.part[lo:hi]) == list(range(5))
        assert ext.one_file(lo, hi) and not ext.one_file(lo - 1, hi)
        pieces = [int(p) for p in ext.piece[lo:hi]]
        piece = m.piece_size

        def room(*held: int) -> int:  # what a tier counts for them (whole pages here)
            mask = np.zeros(ext.pieces, bool)
            mask[list(held)] = True
            return ext.charged(mask, mmap.PAGESIZE) + copy_charge(ext, mmap.PAGESIZE)

        first_room = room(*pieces[:in_first])
        assert room(*pieces[: in_first + 1]) > first_room
    tiers = [f"{first}:{first_room}", f"{second}:{room(*pieces[in_first:4])}"]
    with stagefs.open(pack, tiers=tiers) as fs:
        chain = fs.chain
        assert chain is not None
        got = chain._reserve(shard, pieces)
        t1, t2 = chain.tiers
        assert [got[p][1] if p in got else None for p in pieces] == \
            [t1] * in_first + [t2] * (4 - in_first) + [None]
        assert chain.full
        yield fs, shard, e, piece


def _made_anew(partial: str, at: int, right: int) -> bool:
    """Is the partial copy at ``partial`` not the one whose byte ``at`` was flipped (gone,
    or made anew: that byte unwritten yet, or right)? (Not by its inode number: the old
    copy's is free once it is let go of, and a new file may take it at once.)"""
    if not os.path.exists(partial):
        return True
    with open(partial, "rb") as f:
        f.seek(at)
        return f.read(1) in (bytes([right]), b"\x00")


def test_a_large_file_in_two_tiers_and_the_origin_reads_right(
        large_files: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """One large file's pieces in a RAM tier, a disk tier and no tier: a whole read comes
    from both copies and the origin (only its pieces no tier holds); a range from the
    copies alone; a byte changed in a copy is caught by the checks (a range's pieces', the
    file's), the right bytes come from the origin, and only the bad copy is dropped (a file
    read from several copies once dropped them all)."""
    pack, files = large_files
    name = "v/09.npy"  # 4.9 MiB: 5 checksum pieces
    big = files[name]
    # the file's first two pieces fit the RAM tier, the next two the disk tier, not the last
    with split_over_two_tiers(pack, name, tmp_path / "ram", tmp_path / "disk") as \
            (fs, shard, e, piece):
        assert fs.chain is not None
        ram_t, disk_t = fs.chain.tiers
        off = int(fs.manifest.offset[e])
        before = fs.origin.stats.bytes_read
        assert fs.read(name) == big
        assert fs.origin.stats.bytes_read - before == len(big)  # each byte once
        assert fs.read(name) == big
        # again: the piece in no tier, nothing else
        assert fs.origin.stats.bytes_read - before == len(big) + len(big) - 4 * piece
        mid = fs.origin.stats.bytes_read
        assert fs.read_entry(e, start=piece - 3, length=2 * piece) == \
            big[piece - 3 : 3 * piece - 3]
        assert fs.origin.stats.bytes_read == mid  # pieces 0-2: from RAM and disk
        # a flipped byte in the file's piece 3, in the disk tier's partial copy
        partial = disk_t.path(shard) + ".partial"
        flip_byte(partial, off + 3 * piece + 100)
        # the whole file (from RAM, disk and the origin) fails its check: each copy's part
        # is checked again and only the disk tier's copy is dropped, counted there
        ram_partial = ram_t.path(shard) + ".partial"
        inodes = os.stat(ram_partial).st_ino, os.stat(partial).st_ino
        with caplog.at_level("WARNING", logger="stagefs"):
            assert fs.read(name) == big
        # the warning names the copies the bad bytes came from (it said "stream")
        said = [r.getMessage() for r in caplog.records if "bad bytes from" in r.getMessage()]
        assert said and str(tmp_path / "disk") in said[0] and str(tmp_path / "ram") in said[0]
        assert "the origin" in said[0]
        assert os.stat(ram_partial).st_ino == inodes[0]  # kept
        assert _made_anew(partial, off + 3 * piece + 100, big[3 * piece + 100])
        assert (ram_t.stats.dropped, disk_t.stats.dropped) == (0, 1)
        assert fs.read_entry(e, start=piece - 3, length=2 * piece) == \
            big[piece - 3 : 3 * piece - 3]
        assert fs.read(name) == big
        # a flipped byte in piece 1 (RAM), read as a range: the range's piece check
        flip_byte(ram_t.path(shard) + ".partial", off + piece + 7)
        assert fs.read_entry(e, start=piece, length=10) == big[piece : piece + 10]
        assert _made_anew(ram_partial, off + piece + 7, big[piece + 7])
        assert ram_t.stats.dropped == 1
        assert fs.read(name) == big



def test_the_holders_of_a_large_files_pieces_are_named_by_tier(
        large_files: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path) -> None:
    """``TierChain.piece_holders`` (the preload helper's answer to a mapping of a large
    file): per checksum piece of the file, the tier whose copy holds it written, 0 for
    none: reserved but not yet filled is none; once read, the first two pieces in the first
    tier, the next two in the second, the last in neither; a whole copy holds them all."""
    pack, files = large_files
    name = "v/09.npy"
    with split_over_two_tiers(pack, name, tmp_path / "t1", tmp_path / "t2") as (fs, shard, e, _):
        chain = fs.chain
        assert chain is not None
        assert list(chain.piece_holders(e)) == [0] * 5  # reserved, nothing written yet
        assert fs.read(name) == files[name]
        assert list(chain.piece_holders(e)) == [1, 1, 2, 2, 0]
        small = fs.namespace.file_entry("s/00.txt")
        assert len(chain.piece_holders(small)) == 0  # no piece checksums
    with stagefs.open(pack, tiers=[str(tmp_path / "t3")]) as fs:
        assert fs.chain is not None
        fs.chain.place(shard)
        assert list(fs.chain.piece_holders(e)) == [1] * 5


def test_a_large_file_from_two_tiers_and_the_origin_is_counted_by_holder(
        large_files: tuple[Path, dict[str, bytes]], runtime: Path, memory_dir: Path,
        tmp_path: Path) -> None:
    """The read counters by holder (``stagefs status``): a large file whose pieces are in a
    memory tier, a disk tier and no tier is counted byte for byte where each piece came
    from, the sample once (they counted it all as the origin's: the stream served it)."""
    pack, files = large_files
    name = "v/09.npy"  # 4.9 MiB: 5 checksum pieces
    big = files[name]
    with split_over_two_tiers(pack, name, memory_dir, tmp_path / "disk") as \
            (fs, _, e, piece):
        assert fs.chain is not None
        assert [t.kind for t in fs.chain.tiers] == ["memory", "disk"]

        def holders() -> dict[str, tuple[int, int]]:
            h = fs.status()["holders"]
            return {k: (v["reads"], v["bytes"]) for k, v in h.items() if v["reads"] or v["bytes"]}

        assert fs.read(name) == big  # each piece read from the origin now, into its copy
        assert holders() == {"origin": (1, len(big))}
        assert fs.read(name) == big  # from both copies, the last piece from the origin
        assert holders() == {"origin": (1, 2 * len(big) - 4 * piece),
                             "memory": (1, 2 * piece), "disk": (0, 2 * piece)}
        # a range of pieces 1-2: one from each copy, nothing from the origin
        assert fs.read_entry(e, start=piece, length=2 * piece) == big[piece : 3 * piece]
        assert holders() == {"origin": (1, 2 * len(big) - 4 * piece),
                             "memory": (1, 3 * piece), "disk": (0, 3 * piece)}


def test_a_whole_read_from_two_tiers_and_the_origin_holds_it_in_memory_twice_at_most(
        large_files: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path) -> None:
    """A whole read of a large file whose pieces lie in two tiers and the origin is put
    together in one buffer: at most the buffer and the bytes returned are held at once,
    however large the part one copy gives (each part was copied once more on its way into
    the buffer: a 190 MiB file, 137 MiB of it in a RAM tier, peaked at 2.44 times its size,
    where a read from one holder takes 1)."""
    import tracemalloc

    pack, files = large_files
    name = "v/09.npy"  # 4.9 MiB: 5 checksum pieces, 3 in the RAM tier, 1 on disk, 1 in none
    big = files[name]
    with split_over_two_tiers(pack, name, tmp_path / "ram", tmp_path / "disk", 3) as \
            (fs, _, _, piece):
        assert fs.read(name) == big  # read from the origin into both copies
        before = fs.origin.stats.bytes_read
        tracemalloc.start()
        try:
            data = fs.read(name)  # 3 pieces from RAM, 1 from disk, 1 from the origin
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert data == big
        assert fs.origin.stats.bytes_read - before == len(big) - 4 * piece
        assert peak < 2 * len(big) + piece // 2, (peak, len(big))


def test_a_full_tier_takes_the_room_a_corrupt_copy_leaves(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path) -> None:
    """The tier is full; a whole copy in it turns out corrupt and is dropped: the room it
    leaves opens the tier again and the shard is placed anew in the same process (it stayed
    out, and every later epoch read it from the origin, while the tier was still 'full')."""
    pack, files = dataset
    with stagefs.open(pack) as probe:
        d = data_bytes(probe)
        shard_size = max(s.size for s in probe.manifest.shards)
    cap = int(2.5 * shard_size)
    with stagefs.open(pack, tiers=[f"{tmp_path / 't'}:{cap}"]) as fs:
        chain = fs.chain
        assert chain is not None
        epoch(fs, files, 21)
        tier = chain.tiers[0]
        assert chain.full and tier.stopped == "full"
        whole = sorted(fs.held_shards())
        assert whole
        shard = whole[0]
        m = fs.manifest
        victim = next(p for p in sorted(files) if int(m.shard[m.lookup(p.encode())]) == shard)
        flip_byte(tier.path(shard), int(m.offset[m.lookup(victim.encode())]) + 5)
        assert fs.read(victim) == files[victim]
        assert tier.stats.dropped == 1
        assert chain.wait_idle(60)
        assert shard in fs.held_shards()  # placed again
        assert cap - 2 * m.piece_size <= tier.used_bytes() <= cap
        second = epoch(fs, files, 22)
        # D - C, give or take the room the tier may leave unused (two pieces, above: the
        # 5% this asserted alone failed 1 run in 8, with 1.5 MB of 2 MiB left)
        assert 0.95 * (d - cap) <= second <= d - cap + 2 * m.piece_size, (second, d - cap)


def test_two_processes_dropping_one_corrupt_copy_free_its_room_once(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path) -> None:
    """Two stores of the job read a whole copy, then find it corrupt: the first deletes it
    and frees its room (and places the shard again); the second, reading the copy it had
    open, deletes nothing and frees nothing more (it freed the room twice: the tier went
    over its capacity by a shard, and deleted the new copy if it was there). (Within the
    second before ``b`` looks at its copy again, ``chain.clock``: then it finds it
    replaced, and reads the new one.)"""
    pack, files = dataset
    tier = f"{tmp_path / 't'}:{64 * 2**20}"  # a capacity: its room is counted from the start
    with stagefs.open(pack, tiers=[tier]) as a, stagefs.open(pack, tiers=[tier]) as b:
        assert a.chain is not None and b.chain is not None
        b.chain.clock = lambda: 0.0
        a.chain.prefetch([0])
        assert a.chain.wait_idle(60)
        m = a.manifest
        mine = [p for p in sorted(files) if int(m.shard[m.lookup(p.encode())]) == 0]
        for fs in (a, b):
            assert fs.read(mine[0]) == files[mine[0]]  # each has the copy open now
        room = a.chain.tiers[0].used_bytes()
        path = a.chain.tiers[0].path(0)
        flip_byte(path, int(m.offset[m.lookup(mine[1].encode())]) + 9)
        assert a.read(mine[1]) == files[mine[1]]
        assert a.chain.wait_idle(60)
        assert 0 in a.held_shards()  # placed again
        new = os.stat(path).st_ino
        assert b.read(mine[1]) == files[mine[1]]  # its old copy: bad, dropped
        assert b.chain.tiers[0].stats.dropped == 1
        assert os.stat(path).st_ino == new  # the new copy stays
        assert a.chain.tiers[0].used_bytes() == room
        assert b.read(mine[1]) == files[mine[1]]


@pytest.mark.parametrize("damage", ["whole cut short", "partial cut short", "fill map gone"])
def test_a_copy_cut_short_or_without_its_map_is_placed_anew(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path,
        damage: str) -> None:
    """A tier copy damaged without a wrong byte (a whole copy or a partial one cut short,
    a partial copy's fill map deleted) is deleted, its room freed, and placed anew: in a
    live process and in the next one, later epochs read D - C again (they read the shard
    from the origin every epoch, its room still counted)."""
    pack, files = dataset
    with stagefs.open(pack) as probe:
        d = data_bytes(probe)
        shard_size = max(s.size for s in probe.manifest.shards)
    cap = int(2.5 * shard_size)
    tier = f"{tmp_path / 't'}:{cap}"
    with stagefs.open(pack, tiers=[tier]) as fs:
        assert fs.chain is not None
        epoch(fs, files, 31)
        t = fs.chain.tiers[0]
        whole = sorted(fs.held_shards())
        partial = [s for s in range(len(fs.manifest.shards))
                   if os.path.exists(t.path(s) + ".partial")]
        assert whole and partial
        if damage == "whole cut short":
            os.truncate(t.path(whole[0]), shard_size // 2)
        elif damage == "partial cut short":
            os.truncate(t.path(partial[0]) + ".partial", 1000)
        else:
            os.unlink(t.path(partial[0]) + ".fill")
        # this process reads on: what it meets damaged it drops and places anew (the pieces
        # the copy held come over once more, in the epoch that places them)
        # within 5% of D - C, and the room a tier leaves when the next piece does not fit
        # (under a piece: 4% of this small dataset's D - C); its pages hold the padding
        # between aligned files too (2.4% of C here)
        slack = 0.05 * (d - cap) + fs.manifest.piece_size
        # the copy is placed anew in one of the next epochs (which one depends on when the
        # stream of its shard runs: the process reads the deleted copy's pieces through
        # its open descriptor until then), and from the epoch after, D - C again
        later = [epoch(fs, files, seed) for seed in (32, 33, 36)]
        while abs(later[-1] - (d - cap)) > slack and len(later) < 6:
            later.append(epoch(fs, files, 40 + len(later)))
        assert abs(later[-1] - (d - cap)) <= slack, (later, d - cap)
        assert sum(b - (d - cap) > slack for b in later) <= 1, later  # placed anew once
        assert t.used_bytes() <= cap and dir_bytes(t.root) <= cap
    with stagefs.open(pack, tiers=[tier]) as fs:  # and the next process
        assert fs.chain is not None
        epoch(fs, files, 34)
        later = epoch(fs, files, 35)
        assert abs(later - (d - cap)) <= slack, (later, d - cap)


def test_a_mapped_memory_copy_cut_short_is_no_crash(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """read_many copies out of a mapping of a memory tier's copy; cut short under it, a copy
    out of the mapping would be a SIGBUS (the process died with no message): the batch
    checks the copy's size first, drops it, and reads the origin."""
    pack, files = dataset
    shm = Path("/dev/shm") / f"stagefs-test-{os.getpid()}-{tmp_path.name}"
    try:
        with stagefs.open(pack, tiers=[str(shm)]) as fs:
            assert fs.chain is not None
            fs.chain.prefetch([0])
            assert fs.chain.wait_idle(60)
            m = fs.manifest
            mine = [p for p in sorted(files) if int(m.shard[m.lookup(p.encode())]) == 0]
            assert fs.read_many(mine[:4]) == [files[p] for p in mine[:4]]  # mapped now
            t = fs.chain.tiers[0]
            assert t.kind == "memory" and t._maps
            os.truncate(t.path(0), 4096)
            assert fs.read_many(mine) == [files[p] for p in mine]
            assert t.stats.dropped == 1
            # cut short after that check, under the copy (another process's truncate racing
            # the batch): the copy's fault is caught, the files read again by their holders
            fs.chain.prefetch([0])
            assert fs.chain.wait_idle(60)
            assert fs.read_many(mine[:4]) == [files[p] for p in mine[:4]]
            assert t._maps
            monkeypatch.setattr(t, "_whole_still", lambda shard, size: True)
            os.truncate(t.path(0), 4096)
            assert fs.read_many(mine) == [files[p] for p in mine]
            assert t.stats.dropped == 2
    finally:
        import shutil

        shutil.rmtree(shm, ignore_errors=True)


def _flat_pack(tmp_path: Path, files: dict[str, bytes]) -> dict[str, bytes]:
    """``files`` written to tmp_path/raw and packed, uncompressed, to tmp_path/pack."""
    raw = tmp_path / "raw"
    raw.mkdir()
    for name, data in files.items():
        (raw / name).write_bytes(data)
    stagefs.pack(raw, tmp_path / "pack", compress="none", jobs=1, progress=False,
                 echo=lambda _m: None)
    return files


def test_a_run_read_at_once_from_a_copy_and_the_origin_counts_each_sample_where_it_came(
        runtime: Path, memory_dir: Path, tmp_path: Path) -> None:
    """``read_many`` of adjacent files, some in a memory tier's partial copy and the rest
    from the origin, in one read: each file's sample counted to the holder that gave it,
    as reading them one by one counts (all of them went to the first holder)."""
    files = _flat_pack(tmp_path, {f"f{i:03d}": random_bytes(20_000, 300 + i)
                                  for i in range(200)})
    names = sorted(files)
    with stagefs.open(tmp_path / "pack", tiers=[f"{memory_dir}:1500000"]) as fs:
        assert fs.chain is not None
        fs.read_many(names[:10])  # the tier takes the first piece, then is full
        fs.chain.wait_idle(30)

        def holders() -> dict[str, tuple[int, int]]:
            h = fs.status()["holders"]
            return {k: (v["reads"], v["bytes"]) for k, v in h.items()}

        alone: dict[str, tuple[int, int]] = {}
        for name in names:  # the truth, file by file
            a = holders()
            assert fs.read(name) == files[name]
            c = holders()
            (h,) = [k for k in c if c[k] != a[k]]
            n, b = alone.get(h, (0, 0))
            alone[h] = (n + 1, b + c[h][1] - a[h][1])
        assert set(alone) == {"memory", "origin"}, alone  # a run across both holders
        a = holders()
        assert fs.read_many(names) == [files[n] for n in names]
        c = holders()
        once = {k: (c[k][0] - a[k][0], c[k][1] - a[k][1]) for k in c if c[k] != a[k]}
        assert once == alone


def test_a_tier_passes_over_a_piece_larger_than_its_room_for_smaller_ones(
        runtime: Path, memory_dir: Path, tmp_path: Path) -> None:
    """A tier of 1.3 MB and files of 700 kB: the first piece (two files, 1.4 MB) does not
    fit, the next ones (one file each) do. The tier was stopped by the first and held
    nothing; it holds one now, and a second epoch reads it from there."""
    files = _flat_pack(tmp_path, {f"f{i:02d}": random_bytes(700_000, 500 + i)
                                  for i in range(12)})
    with stagefs.open(tmp_path / "pack", tiers=[f"{memory_dir}:1300000"]) as fs:
        assert fs.chain is not None
        for _ in range(2):
            for name in sorted(files):
                assert fs.read(name) == files[name]
            fs.chain.wait_idle(30)
        tier = fs.status()["tiers"][0]
        assert tier["pieces"] >= 1 and 700_000 <= tier["bytes_used"] <= 1_300_000, tier
        assert fs.status()["holders"]["memory"]["reads"] >= 1


def test_ranges_of_a_large_raw_file_in_place_read_each_byte_once_from_the_origin(
        runtime: Path, tmp_path: Path) -> None:
    """A raw file used in place, larger than the tier, read by ranges of a piece, several
    at once (a FUSE mount's READs): each byte comes from the origin once. Each range read
    the whole file first to learn its piece sums, at once by each READ, then the range:
    70 MiB through a mount cost 210 MiB of the origin. Once a tier holds the file whole, a
    range of its copy is still checked (its pieces' sums from the copy, against the file's
    sum learnt when it was placed)."""
    root = tmp_path / "raw"
    root.mkdir()
    big = random_bytes(6 * 2**20 + 123, 77)
    (root / "big").write_bytes(big)
    with stagefs.open(root, tiers=[f"{tmp_path / 'small'}:3MiB"]) as fs:
        e = fs.namespace.file_entry("big")
        piece = int(fs.manifest.piece_size)
        with ThreadPoolExecutor(4) as pool:
            parts = list(pool.map(lambda k: fs.read_entry(e, "big", k, piece),
                                  range(0, len(big), piece)))
        assert b"".join(parts) == big
        assert fs.origin.stats.bytes_read == len(big)
    with stagefs.open(root, tiers=[str(tmp_path / "large")]) as fs:
        assert fs.chain is not None
        assert fs.read("big") == big
        assert fs.chain.wait_idle(30) and fs.held_shards()
        before = fs.origin.stats.bytes_read
        flip_byte(fs.chain.tiers[0].path(0), int(fs.manifest.offset[e]) + piece)
        assert fs.read_entry(e, "big", piece + 5, 10) == big[piece + 5 : piece + 15]
        assert fs.origin.stats.bytes_read > before  # the copy's bad piece: from the origin


def test_staging_into_a_tier_smaller_than_a_shard_counts_its_pieces_filled(
        large_files: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path) -> None:
    """Staging (``place``, as ``stagefs stage`` and a node daemon do) into a tier with room
    for part of a shard: the files it copies into the partial copy are counted as filled
    (placed: none, the shard is not whole). They were counted nowhere: a stage into small
    tiers showed 0 placed and 0 filled while the tiers held 48 MiB. Placed again, nothing
    more is copied, nor counted."""
    pack, _ = large_files
    with stagefs.open(pack, tiers=[f"{tmp_path / 't'}:6MiB"]) as fs:
        assert fs.chain is not None
        assert fs.chain.place(0) == "full"
        tier = fs.status()["tiers"][0]
        ext = fs.chain._extents_of(0)
        held = fs.chain.partial_copies(0)[0].bits.astype(bool)
        assert tier["placed"] == 0 and tier["filled"] == int(held.sum()) > 0, tier
        assert tier["filled_bytes"] == int((ext.ends - ext.offs)[held].sum()), tier
        assert fs.chain.place(0) == "full"
        assert fs.status()["tiers"][0]["filled_bytes"] == tier["filled_bytes"]


def test_status_says_a_shard_held_in_part_is_not_filling(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A tier without room for every piece keeps shards in part for the job: `stagefs
    status` called them "filling" after the epochs had ended, as if staging were under way
    or left to resume."""
    from stagefs.stage import print_status

    pack, files = dataset
    with stagefs.open(pack, tiers=[f"{tmp_path / 'ram'}:{3 * 2**20}"]) as fs:
        epoch(fs, files, 7)
    assert print_status(str(runtime)) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| tier"))
    assert "held in part" in header and "filling" not in header, header
    row = next(line for line in out.splitlines() if str(tmp_path / "ram") in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert int(cells[3]) >= 1  # the shard it holds pieces of


def test_pieces_reserved_together_are_counted_as_one_by_one_in_one_allocation_a_run(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream reserves its shard's pieces in a few calls: the pieces that all fit in the
    first tier are allocated once for each run of consecutive ones and its room counted
    once, to the byte what reserving them one by one counts; the same pieces are reserved."""
    from stagefs.tiers import fill as fill_mod

    pack, _files = dataset
    calls: list[tuple[int, int]] = []
    real = fill_mod._reserve

    def counted(fd: int, offset: int, length: int) -> None:
        calls.append((offset, length))
        real(fd, offset, length)

    monkeypatch.setattr(fill_mod, "_reserve", counted)
    picked = [0, 1, 2, 5, 6]
    held = {}
    for how in ("together", "one by one"):
        tier = tmp_path / how.replace(" ", "-")
        with stagefs.open(pack, tiers=[str(tier)], runtime=runtime / how[:3]) as fs:
            chain = fs.chain
            assert chain is not None
            ctl = chain.stream.controller
            ctl.most = ctl.target = 0
            assert chain._extents_of(1).pieces > max(picked)
            del calls[:]
            if how == "together":
                got = chain._reserve(1, picked)
                assert len(calls) == 2  # runs 0-2 and 5-6
            else:
                got = {}
                for p in picked:
                    got.update(chain._reserve(1, [p]))
                assert len(calls) == len(picked)
            assert sorted(got) == picked
            [(f, t)] = chain._fills[1]
            assert t.room is not None
            held[how] = (np.flatnonzero(f.res).tolist(), t.room.used(), t.stats.pieces)
    assert held["together"] == held["one by one"]
    assert held["together"][0] == picked


def test_a_first_tier_that_cannot_allocate_a_batch_keeps_no_copy_of_the_shard(
        dataset: tuple[Path, dict[str, bytes]], runtime: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The first tier's file system refuses every allocation (a quota, EDQUOT, that its free
    space does not show): the pieces asked for together go to the next tier, and the first
    keeps no copy of the shard made for them (nor counts one), as reserving them one by one
    leaves it; `stagefs status` says it holds nothing in part."""
    import errno
    import json

    from stagefs.stage import print_status
    from stagefs.tiers import fill as fill_mod

    pack, _files = dataset
    real = fill_mod._reserve
    first = tmp_path / "quota"

    def over_quota(fd: int, offset: int, length: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(first)):
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
        real(fd, offset, length)

    monkeypatch.setattr(fill_mod, "_reserve", over_quota)
    with stagefs.open(pack, tiers=[str(first), str(tmp_path / "disk")]) as fs:
        chain = fs.chain
        assert chain is not None
        ctl = chain.stream.controller
        ctl.most = ctl.target = 0
        picked = [0, 1, 2, 5]
        got = chain._reserve(1, picked)
        quota, disk = chain.tiers
        assert sorted(got) == picked and all(t is disk for _, t in got.values())
        assert quota.stopped is not None
        assert [t for _, t in chain._fills[1]] == [disk]
        assert os.listdir(quota.dir) == []
        assert quota.room is not None and quota.room.used() == 0
    assert print_status(str(runtime), as_json=True) == 0
    rows = {t["path"]: t for t in json.loads(capsys.readouterr().out)["tiers"]}
    assert rows[str(first)]["shards_filling"] == 0, rows


def test_a_partial_copy_s_fill_map_is_allocated_when_it_is_made(
        tmp_path: Path, runtime: Path) -> None:
    """The fill map of a partial copy has its blocks when the copy is made, as its header's
    block does (both counted in ``copy_charge``): a page of it first touched through the
    mapping once the tier's file system was full (a tmpfs other programs filled after the
    copy was made; 20,000 files in one shard) was a SIGBUS that killed the reader."""
    from stagefs.tiers.fill import FILL_SUFFIX, map_size

    files = {f"f{i:05d}.txt": random_bytes(50, i) for i in range(10_000)}
    pack = pack_files(tmp_path, "tiny", files)
    with stagefs.open(pack, tiers=[str(tmp_path / "ram")]) as fs:
        chain = fs.chain
        assert chain is not None
        ctl = chain.stream.controller
        ctl.most = ctl.target = 0
        ext = chain._extents_of(0)
        assert map_size(ext) > 2 * 4096  # pages after the first: set as the files fill
        assert chain._reserve(0, [0])
        [(f, t)] = chain._fills[0]
        st = os.stat(t.path(0) + FILL_SUFFIX)
        assert st.st_size == map_size(ext)
        assert st.st_blocks * 512 >= map_size(ext)
        assert f.res[0] and not f.bits.any()
