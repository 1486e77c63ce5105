"""The loaders users pick today, each converted and read with its own documented settings
for shuffled training reads. Optional: a peer that is not installed is left out.

These packages need torchvision at import time (MosaicML Streaming imports it in
``streaming.vision``), which has no CPU build that fits the pinned torch here; a stand-in
module with a real spec is registered when it is missing (``_torchvision_stand_in``). None
of the code paths measured here uses it. MosaicML Streaming pins numpy<2.2, so the peers
usually live in their own virtual environment (``--peer-python``).
"""

from __future__ import annotations

import glob
import importlib.machinery
import os
import shutil
import sys
import time
import types
from collections.abc import Iterator
from typing import Any

from stagefs.bench.base import Context, _Base

__all__ = ["LitDataSystem", "StreamingSystem", "WebDatasetSystem"]

SHARD_BYTES = 64 * 2**20  # the same shard size for every format (stagefs packs: 64 MiB)


def _torchvision_stand_in() -> None:
    try:
        import torchvision  # noqa: F401
        return
    except ImportError:
        pass
    import torch.utils.data

    def module(name: str) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        m.__path__ = []
        sys.modules[name] = m
        return m

    tv, datasets = module("torchvision"), module("torchvision.datasets")
    transforms, functional = module("torchvision.transforms"), module(
        "torchvision.transforms.functional")

    class VisionDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
        """Stand-in: never instantiated by the benchmark."""

    def to_tensor(x: Any) -> Any:
        raise NotImplementedError("torchvision stand-in")

    datasets.VisionDataset = VisionDataset  # type: ignore[attr-defined]
    functional.to_tensor = to_tensor  # type: ignore[attr-defined]
    tv.datasets, tv.transforms = datasets, transforms  # type: ignore[attr-defined]
    transforms.functional = functional  # type: ignore[attr-defined]


def _missing(module: str) -> str | None:
    try:
        if module in ("streaming", "litdata"):
            _torchvision_stand_in()
        __import__(module)
    except Exception as exc:  # any import failure means: not usable here
        return f"import {module} failed: {type(exc).__name__}: {exc}"
    return None


def _samples(ctx: Context) -> Iterator[tuple[str, bytes]]:
    for rel in ctx.files():
        with open(os.path.join(ctx.raw, rel), "rb") as f:
            yield rel, f.read()


class WebDatasetSystem(_Base):
    name, title = "webdataset", "WebDataset, tar shards"
    interpreter = "peers"
    settings = ("tar shards of 64 MiB (ShardWriter); WebDataset(shardshuffle=100) + "
                ".shuffle(1000): shard shuffle plus a sample shuffle buffer, as its docs "
                "recommend (webdataset.github.io/webdataset/sharding); it reads shards on a "
                "mounted path in place (its FileCache does not copy local files)")

    def missing(self) -> str | None:
        return _missing("webdataset")

    def convert(self, ctx: Context) -> str:
        import webdataset as wds

        dest = ctx.out(self.name)
        shutil.rmtree(dest, ignore_errors=True)
        os.makedirs(dest)
        with wds.ShardWriter(os.path.join(dest, "shard-%06d.tar"), maxsize=SHARD_BYTES,
                             verbose=0) as sink:
            for i, (rel, data) in enumerate(_samples(ctx)):
                sink.write({"__key__": f"{i:09d}", "bin": data, "path": os.fsencode(rel)})
        return dest

    def open(self, ctx: Context, run: int) -> None:
        import webdataset

        super().open(ctx, run)
        self.wds = webdataset
        self.urls = sorted(glob.glob(os.path.join(ctx.out(self.name), "shard-*.tar")))

    def epoch(self, ctx: Context, run: int, epoch: int) -> Iterator[tuple[str, Any]]:
        wds = self.wds
        ds = wds.WebDataset(self.urls, shardshuffle=100, seed=run * 1000 + epoch,
                            empty_check=False).shuffle(1000, seed=run * 1000 + epoch)
        for sample in ds:
            yield os.fsdecode(sample["path"]), sample["bin"]


class StreamingSystem(_Base):
    name, title = "streaming", "MosaicML Streaming, MDS"
    interpreter = "peers"
    settings = ("MDSWriter, 64 MiB shards, no compression; StreamingDataset(remote=MDS dir on "
                "the origin, local=node-local cache, shuffle=True) with its default "
                "shuffle_algo='py1e', which its docs recommend ('merely setting shuffle=True is "
                "performant in nearly all cases': docs.mosaicml.com/projects/streaming, "
                "Shuffling); the local cache starts empty in each run")

    def missing(self) -> str | None:
        return _missing("streaming")

    def convert(self, ctx: Context) -> str:
        _torchvision_stand_in()
        from streaming import MDSWriter

        dest = ctx.out(self.name)
        shutil.rmtree(dest, ignore_errors=True)
        with MDSWriter(out=dest, columns={"path": "str", "data": "bytes"},
                       size_limit=SHARD_BYTES) as w:
            for rel, data in _samples(ctx):
                w.write({"path": rel, "data": data})
        return dest

    def open(self, ctx: Context, run: int) -> None:
        _torchvision_stand_in()
        from streaming import StreamingDataset
        from streaming.base.util import clean_stale_shared_memory

        super().open(ctx, run)
        self._t0 = time.time()
        clean_stale_shared_memory()
        cache = ctx.scratch(self.name)
        shutil.rmtree(cache, ignore_errors=True)
        self.ds = StreamingDataset(remote=ctx.out(self.name), local=cache, shuffle=True,
                                   shuffle_seed=run + 1, batch_size=64)

    def epoch(self, ctx: Context, run: int, epoch: int) -> Iterator[tuple[str, Any]]:
        for sample in self.ds:  # each pass over the dataset is its next epoch
            yield sample["path"], sample["data"]

    def close(self) -> None:
        ds = getattr(self, "ds", None)
        if ds is not None:
            del self.ds
        # it leaves lock files in /tmp: remove the ones this run made
        for p in glob.glob("/tmp/*_filelock"):
            try:
                if os.stat(p).st_mtime >= self._t0 - 1:
                    os.unlink(p)
            except OSError:
                pass


def _litdata_item(item: tuple[str, str]) -> dict[str, Any]:
    raw, rel = item
    with open(os.path.join(raw, rel), "rb") as f:
        return {"path": rel, "data": f.read()}


class LitDataSystem(_Base):
    name, title = "litdata", "LitData, optimize() chunks"
    interpreter = "peers"
    settings = ("optimize(chunk_bytes='64MB'); StreamingDataset('local:' + origin dir, "
                "cache_dir=node-local, shuffle=True), the form its README gives for a dataset "
                "on a shared drive (github.com/Lightning-AI/litData, README); the cache starts "
                "empty in each run")

    def missing(self) -> str | None:
        return _missing("litdata")

    def convert(self, ctx: Context) -> str:
        _torchvision_stand_in()
        from litdata import optimize

        dest = ctx.out(self.name)
        shutil.rmtree(dest, ignore_errors=True)
        optimize(fn=_litdata_item, inputs=[(ctx.raw, rel) for rel in ctx.files()],
                 output_dir=dest, chunk_bytes="64MB", num_workers=2, mode="overwrite")
        return dest

    def open(self, ctx: Context, run: int) -> None:
        _torchvision_stand_in()
        from litdata import StreamingDataset

        super().open(ctx, run)
        cache = ctx.scratch(self.name)
        shutil.rmtree(cache, ignore_errors=True)
        os.makedirs(cache)
        self.ds = StreamingDataset("local:" + ctx.out(self.name), cache_dir=cache,
                                   shuffle=True, seed=run)

    def epoch(self, ctx: Context, run: int, epoch: int) -> Iterator[tuple[str, Any]]:
        self.ds.set_epoch(epoch + 1)
        for sample in self.ds:
            yield sample["path"], sample["data"]  # data: a memoryview; hashed as is
