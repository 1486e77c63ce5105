"""Every holder of shard bytes passes the same checks (stagefs/testing/holders.py): a tier,
the pack origin, the in-place origin, the partial copies a tier fills, and a peer over a
real socket."""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import stagefs
from conftest import random_bytes, text_bytes
from stagefs.config import TierSpec
from stagefs.format import KIND_FILE, MANIFEST_NAME, Manifest, ShardHeader, checksum
from stagefs.format.spec import SHARD_HEADER
from stagefs.inplace import open_manifest
from stagefs.net.auth import new_token
from stagefs.net.client import PeerClient, PeerSource
from stagefs.net.server import ShardServer
from stagefs.runtime import Runtime, proc_start
from stagefs.testing.holders import CHECKS, HolderCase, HolderCheckFailed, check_ranges
from stagefs.tiers.base import ShardSource, SourceUnavailable
from stagefs.tiers.chain import TierChain
from stagefs.tiers.inplace import InPlaceOrigin, SumTable
from stagefs.tiers.origin import PackOrigin
from stagefs.tiers.tier import DirTier

SHARD_SIZE = 16 * 1024
ABSENT = 1  # the shard each holder does not hold


def make_raw(root: Path, n: int = 150, seed: int = 11) -> None:
    """Small files (many to a shard: an in-place range read spans more than 8 of them),
    random and text, a few empty."""
    rng = random.Random(seed)
    for i in range(n):
        kind = rng.choice(["random", "random", "text", "empty"])
        size = rng.randint(1, 2000)
        data = {"random": random_bytes(size, i), "text": text_bytes(size, i), "empty": b""}[kind]
        p = root / f"d{i % 4}" / f"f{i:04d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("holders")
    make_raw(base / "raw")
    stagefs.pack(base / "raw", base / "pack", shard_size=SHARD_SIZE, jobs=1, progress=False,
                 echo=lambda _m: None)
    return base / "raw", base / "pack"


@pytest.fixture(autouse=True)
def _own_runtime(runtime: Path) -> Path:
    return runtime


class _PackCase(HolderCase):
    """A holder of a pack's shards; a private copy of the pack, whose absent shard is gone."""

    def __init__(self, pack: Path, tmp: Path) -> None:
        self.pristine = pack
        self.pack = tmp / "pack"
        shutil.copytree(pack, self.pack)
        self.manifest = Manifest(str(self.pack / MANIFEST_NAME))
        self.absent = ABSENT
        (self.pack / self.manifest.shards[ABSENT].name).unlink()
        self._true: dict[int, bytes] = {}

    def shard_bytes(self, shard: int) -> bytes:
        if shard not in self._true:
            self._true[shard] = (self.pristine / self.manifest.shards[shard].name).read_bytes()
        return self._true[shard]

    def stored_path(self, shard: int) -> str:
        return str(self.pack / self.manifest.shards[shard].name)

    def corrupt(self, shard: int, offset: int, value: int) -> None:
        fd = os.open(self.stored_path(shard), os.O_WRONLY)
        try:
            os.pwrite(fd, bytes([value]), offset)
        finally:
            os.close(fd)

    def close(self) -> None:
        super().close()
        self.manifest.close()


class PackOriginCase(_PackCase):
    name = "PackOrigin"

    def __init__(self, pack: Path, tmp: Path) -> None:
        super().__init__(pack, tmp)
        self.holder = PackOrigin(str(self.pack), self.manifest)


class DirTierCase(_PackCase):
    name = "DirTier"

    def __init__(self, pack: Path, tmp: Path) -> None:
        super().__init__(pack, tmp)
        self.tier = DirTier(TierSpec(str(tmp / "tier"), None), self.manifest)
        for s in range(len(self.manifest.shards)):
            if s != ABSENT:
                shutil.copyfile(self.stored_path(s), self.tier.path(s))
        self.holder = self.tier

    def corrupt(self, shard: int, offset: int, value: int) -> None:
        fd = os.open(self.tier.path(shard), os.O_WRONLY)
        try:
            os.pwrite(fd, bytes([value]), offset)
        finally:
            os.close(fd)


class _Unreachable:
    """An origin that never answers."""

    name = "origin (unreachable)"

    def pread(self, shard: int, offset: int, length: int) -> bytes:
        raise SourceUnavailable("unreachable")

    def close(self) -> None:
        pass


class FillSourceCase(_PackCase):
    """The chain's partial copies in one tier: every piece of every held shard reserved
    there and every file written into its copy, which stays partial (the stream is another
    process's: this one copies nothing); the origin unreachable."""

    name = "partial copies (TierChain)"

    def __init__(self, pack: Path, tmp: Path, runtime: Path) -> None:
        super().__init__(pack, tmp)
        m = self.manifest
        claims = runtime / "claims"
        claims.mkdir(parents=True, exist_ok=True)
        owner = f"{os.getppid()} {proc_start(os.getppid())}"
        for s in range(len(m.shards)):
            (claims / f"{m.pack_id.hex()}.{s}").write_text(owner)
        self.runtime = Runtime(runtime).open()
        self.origin = PackOrigin(str(self.pack), m)
        self.chain = TierChain(m, _Unreachable(), [TierSpec(str(tmp / "tier"), None)],
                               self.runtime, origin_path=str(self.pack))
        for s in range(len(m.shards)):
            if s == ABSENT:
                continue
            ext = self.chain._extents_of(s)
            got = self.chain._reserve(s, range(ext.pieces))
            assert len(got) == ext.pieces
            fill, true = got[0][0], self.shard_bytes(s)
            for a, b in zip(fill.ext.offs, fill.ext.ends, strict=True):
                fill.write(int(a), true[a:b])
            assert fill.complete()
        self.holder: ShardSource = self.chain._fill_src[id(self.chain.tiers[0])]

    def corrupt(self, shard: int, offset: int, value: int) -> None:
        self.chain._fills[shard][0][0].put(offset, bytes([value]))

    def close(self) -> None:
        self.chain.close()
        self.origin.close()
        self.runtime.unregister()
        self.manifest.close()


class StreamSourceCase(FillSourceCase):
    """The same copies as the stream serves them (tiers/stream.py), with the origin it would
    read the rest from unreachable: it serves what the copies hold and nothing else."""

    name = "stream (TierChain)"

    def __init__(self, pack: Path, tmp: Path, runtime: Path) -> None:
        super().__init__(pack, tmp, runtime)
        self.holder = self.chain.stream.source


class PeerCase(_PackCase):
    """A peer: a ShardServer on loopback serving the pack copy, read through PeerSource."""

    name = "PeerSource"

    def __init__(self, pack: Path, tmp: Path) -> None:
        super().__init__(pack, tmp)
        token = new_token()
        self.server = ShardServer(
            self.manifest, token,
            lambda s: None if s == ABSENT else self.stored_path(s), "127.0.0.1").start()
        host, port = self.server.address
        self.holder = PeerSource(PeerClient(host, port, token, pack_id=self.manifest.pack_id))

    def close(self) -> None:
        self.holder.close()
        self.server.close()
        self.manifest.close()


class InPlaceCase(HolderCase):
    """A raw directory read through virtual shards; the files of the absent shard are gone
    (a file gone since the scan is a SourceChangedError); every file's sum is known."""

    name = "InPlaceOrigin"

    def __init__(self, raw: Path, tmp: Path, runtime: Path) -> None:
        self.root = tmp / "raw"
        shutil.copytree(raw, self.root)
        self.runtime = Runtime(runtime).open()
        m, cache, _ = open_manifest(str(self.root), self.runtime, shard_size=SHARD_SIZE,
                                    progress=False)
        self.manifest = m
        self.sums = SumTable(cache.sums_path, len(m))
        self._true = {s: self._synthesise(s) for s in range(len(m.shards))}
        for e in range(len(m)):
            if m.kind[e] == KIND_FILE:
                self.sums.record(e, checksum(self._file(e).read_bytes()))
        self.absent = ABSENT
        for e in self._entries(ABSENT):
            self._file(e).unlink()
        self.holder = InPlaceOrigin(str(self.root), m)

    def _file(self, e: int) -> Path:
        return self.root / os.fsdecode(self.manifest.path_of(e))

    def _entries(self, shard: int) -> list[int]:
        m = self.manifest
        return [e for e in range(len(m)) if m.kind[e] == KIND_FILE and m.shard[e] == shard
                and m.stored[e] > 0]

    def _synthesise(self, shard: int) -> bytes:
        m = self.manifest
        size = m.shards[shard].size
        out = bytearray(size)
        out[: SHARD_HEADER.size] = ShardHeader(shard, m.pack_id, size - SHARD_HEADER.size).encode()
        for e in self._entries(shard):
            out[m.offset[e] : m.offset[e] + m.stored[e]] = self._file(e).read_bytes()
        return bytes(out)

    def shard_bytes(self, shard: int) -> bytes:
        return self._true[shard]

    def corrupt(self, shard: int, offset: int, value: int) -> None:
        m = self.manifest
        e = next(e for e in self._entries(shard) if m.offset[e] <= offset < m.offset[e] +
                 m.stored[e])
        path = self._file(e)
        st = path.stat()
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, bytes([value]), offset - m.offset[e])
        finally:
            os.close(fd)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # as the scan saw it

    def close(self) -> None:
        self.holder.close()
        self.sums.close()
        self.manifest.close()
        self.runtime.unregister()


HOLDERS: dict[str, Callable[[Path, Path, Path, Path], HolderCase]] = {
    "dir-tier": lambda raw, pack, tmp, rt: DirTierCase(pack, tmp),
    "pack-origin": lambda raw, pack, tmp, rt: PackOriginCase(pack, tmp),
    "in-place-origin": lambda raw, pack, tmp, rt: InPlaceCase(raw, tmp, rt),
    "fill-source": lambda raw, pack, tmp, rt: FillSourceCase(pack, tmp, rt),
    "stream-source": lambda raw, pack, tmp, rt: StreamSourceCase(pack, tmp, rt),
    "peer": lambda raw, pack, tmp, rt: PeerCase(pack, tmp),
}


@pytest.fixture(params=sorted(HOLDERS))
def case(request: pytest.FixtureRequest, dataset: tuple[Path, Path], tmp_path: Path,
         runtime: Path) -> Iterator[HolderCase]:
    raw, pack = dataset
    c = HOLDERS[request.param](raw, pack, tmp_path, runtime)
    try:
        yield c
    finally:
        c.close()


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_holder(check: Callable[[HolderCase], None], case: HolderCase) -> None:
    check(case)


def test_the_suite_catches_a_holder_that_returns_wrong_bytes(
        dataset: tuple[Path, Path], tmp_path: Path) -> None:
    """The checks can fail: a holder that reads one byte too far is caught."""
    c = PackOriginCase(dataset[1], tmp_path)
    inner = c.holder

    class OffByOne:
        name = "off by one"

        def pread(self, shard: int, offset: int, length: int) -> bytes:
            return inner.pread(shard, offset + 1, length) if length else b""

        def close(self) -> None:
            inner.close()

    c.holder = OffByOne()
    try:
        with pytest.raises(HolderCheckFailed, match="PackOrigin: shard 0 \\[0, 1\\)"):
            check_ranges(c)
    finally:
        c.close()
