"""``tiers/base.py gather``: many stored files read at once and hashed as they arrive. The C
accelerator and the Python loop (its reference) give the same bytes, hashes and stops; an
item that cannot be read whole is None (the caller reads it again, alone)."""

from __future__ import annotations

import mmap
import os
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import xxhash

from stagefs.tiers import base

C = pytest.param("c", marks=pytest.mark.skipif(
    base._c_gather is None, reason="the C accelerator is not built (needs a C compiler)"))


@pytest.fixture(params=[C, "python"])
def form(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "python":
        monkeypatch.setattr(base, "_c_gather", None)
    return str(request.param)


@pytest.fixture
def blob(tmp_path: Path) -> Iterator[tuple[int, bytes, Any]]:
    """An open file of random bytes, its bytes, and a read-only mapping of it."""
    data = random.Random(3).randbytes(300_000)
    path = tmp_path / "shard"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    try:
        yield fd, data, mm
    finally:
        mm.close()
        os.close(fd)


def test_items_from_a_file_and_a_mapping_with_their_hashes(form: str,
                                                           blob: tuple[int, bytes, Any]) -> None:
    fd, data, mm = blob
    # adjacent items (one preadv), a gap, an item of 1 byte, one from the mapping, one
    # overlapping another, one over 240 bytes and one under 16 (the hash's branches)
    items = [(fd, 0, 1000), (fd, 1000, 5000), (fd, 6000, 1), (fd, 9000, 70_000),
             (mm, 123, 4567), (fd, 500, 700), (mm, 299_990, 10), (fd, 299_000, 1000)]
    got = base.gather(*zip(*items, strict=True))
    want = [data[o : o + n] for _, o, n in items]
    assert got.datas == want
    assert got.sums == [xxhash.xxh3_64_intdigest(w) for w in want]
    assert (got.done, got.waited) == (len(items), False)


def test_what_cannot_be_read_whole_is_none(form: str, blob: tuple[int, bytes, Any]) -> None:
    """Past the end of the file (in a run with good items before it), past the end of a
    mapping, no source (-1), a closed descriptor: None and a hash of 0; the rest read."""
    fd, data, mm = blob
    closed = os.open(os.devnull, os.O_RDONLY)
    os.close(closed)
    items = [(fd, 299_000, 500), (fd, 299_500, 1000), (fd, 0, 10), (mm, 299_999, 2),
             (-1, 0, 10), (closed, 0, 10), (fd, 400_000, 10)]
    got = base.gather(*zip(*items, strict=True))
    assert got.datas == [data[299_000:299_500], None, data[:10], None, None, None, None]
    assert got.sums[1:] == [0, xxhash.xxh3_64_intdigest(data[:10]), 0, 0, 0, 0]


def test_bad_arguments_raise(form: str, blob: tuple[int, bytes, Any]) -> None:
    fd, _, _ = blob
    with pytest.raises(ValueError):
        base.gather([-5], [0], [10])
    if form == "c":  # the Python loop indexes them: an IndexError or a short result
        with pytest.raises(ValueError):
            base.gather([fd, fd], [0], [10, 10])
        with pytest.raises(ValueError):  # offset + length past 2**63: no read, no crash
            base.gather([b"abcdef"], [2**63 - 4], [8])


def test_reads_stop_after_the_first_that_waited(form: str,
                                                blob: tuple[int, bytes, Any]) -> None:
    """``slow_s``: every read takes longer than 0 s plus its bytes at an endless copy rate,
    so the first one waited: one item read, the rest left for the caller's threads."""
    fd, data, _ = blob
    items = [(fd, 0, 100), (fd, 5000, 100), (fd, 9000, 100)]
    got = base.gather(*zip(*items, strict=True), slow_s=0.0, copy_rate=float("inf"))
    assert (got.done, got.waited) == (1, True)
    assert got.datas == [data[:100], None, None]
    got = base.gather(*zip(*items, strict=True), slow_s=3600.0, copy_rate=1.0)
    assert (got.done, got.waited) == (3, False)


def test_parts_at_once_give_the_same_as_one(form: str, blob: tuple[int, bytes, Any]) -> None:
    fd, data, mm = blob
    rnd = random.Random(4)
    items = []
    for _ in range(61):
        n = rnd.randrange(1, 20_000)
        o = rnd.randrange(0, len(data) - n)
        items.append((rnd.choice([fd, mm]), o, n))
    one = base.gather(*zip(*items, strict=True))
    with ThreadPoolExecutor(3) as pool:
        parts = base.gather(*zip(*items, strict=True), pool=pool, parts=4)
    assert parts == one
    assert one.datas == [data[o : o + n] for _, o, n in items]


class _Counted(ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(3)
        self.submitted = 0

    def submit(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        self.submitted += 1
        return super().submit(*args, **kwargs)


def test_a_batch_of_few_bytes_is_gathered_in_one_part(blob: tuple[int, bytes, Any]) -> None:
    """A part is GATHER_PART items and GATHER_PART_BYTES at least: 64 small documents are
    copied sooner than a thread wakes, so they are not split (a split cost twice the time);
    a batch of as many large items is."""
    if base._c_gather is None:
        pytest.skip("the C accelerator is not built (needs a C compiler): never split")
    fd, data, mm = blob
    small = [(mm if k % 2 else fd, 97 * k, 1000) for k in range(64)]
    large = [(mm if k % 2 else fd, 97 * k, base.GATHER_PART_BYTES // 16) for k in range(64)]
    with _Counted() as pool:
        one = base.gather(*zip(*small, strict=True), pool=pool, parts=4)
        assert pool.submitted == 0
        assert one.datas == [data[o : o + n] for _, o, n in small]
        split = base.gather(*zip(*large, strict=True), pool=pool, parts=4)
        assert pool.submitted == 3  # four parts, one in this thread
        assert split.datas == [data[o : o + n] for _, o, n in large]


needs_c = pytest.mark.skipif(base._c_gather is None,
                             reason="the C accelerator is not built (needs a C compiler)")


@needs_c
def test_a_mapping_cut_short_under_the_copy_gives_none_not_sigbus(tmp_path: Path) -> None:
    """Another process cutting a mapped file short turns a copy out of the mapping into a
    SIGBUS, which killed the reader: the C form catches it in the copying thread, and the
    item is None (the caller reads it again and finds the copy cut short); the items before
    the cut are read, and a thread pool's parts survive it as well."""
    page = mmap.PAGESIZE
    data = random.Random(5).randbytes(64 * page)
    path = tmp_path / "copy"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    try:
        os.truncate(path, 16 * page)  # the mapping still says 64 pages
        items = [(mm, 0, 1000), (mm, 20 * page, 5000), (mm, 15 * page, 2 * page),
                 (mm, 3 * page, page), (mm, 63 * page, page)]
        got = base.gather(*zip(*items, strict=True))
        assert got.datas == [data[:1000], None, None, data[3 * page : 4 * page], None]
        assert got.sums[0] == xxhash.xxh3_64_intdigest(data[:1000]) and got.sums[1] == 0
        # (large enough to be split: GATHER_PART_BYTES a part at least)
        many = [(mm, (k % 61) * page, 3 * page) for k in range(64)]
        assert sum(n for _, _, n in many) >= 2 * base.GATHER_PART_BYTES
        with ThreadPoolExecutor(3) as pool:
            parts = base.gather(*zip(*many, strict=True), pool=pool, parts=4)
        assert parts.datas == [data[o : o + n] if o + n <= 16 * page else None
                               for _, o, n in many]
    finally:
        mm.close()
        os.close(fd)


@needs_c
@pytest.mark.parametrize("faulthandler", [False, True])
def test_a_sigbus_outside_a_copy_still_ends_the_process(tmp_path: Path,
                                                        faulthandler: bool) -> None:
    """The guard is for gather's copies only: after it has caught one, a SIGBUS anywhere
    else ends the process as before (with faulthandler's report where it is on)."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "bus.py"
    script.write_text(
        "import mmap, os\n"
        "from stagefs.tiers import base\n"
        f"p = {str(tmp_path / 'f')!r}\n"
        "open(p, 'wb').write(b'x' * 8 * mmap.PAGESIZE)\n"
        "fd = os.open(p, os.O_RDONLY)\n"
        "mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)\n"
        "os.truncate(p, mmap.PAGESIZE)\n"
        "got = base.gather([mm], [4 * mmap.PAGESIZE], [10])\n"
        "print('caught', got.datas == [None], flush=True)\n"
        "print('read', mm[5 * mmap.PAGESIZE], flush=True)\n")
    args = [sys.executable] + (["-X", "faulthandler"] if faulthandler else []) + [str(script)]
    run = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert "caught True" in run.stdout, run.stderr
    assert "read" not in run.stdout.replace("caught", "")
    assert run.returncode == -signal.SIGBUS, (run.returncode, run.stderr)
    if faulthandler:
        assert "Bus error" in run.stderr
