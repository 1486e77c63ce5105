"""PyTorch front end: a map-style dataset over a stagefs Store, a distributed sampler that
knows every future read (clairvoyant prefetching, locality, resumable state), and a data-stall
meter. Needs PyTorch (``pip install 'stagefs[torch]'``); ``import stagefs`` never imports it.

::

    from torch.utils.data import DataLoader
    from stagefs.torch import FileDataset, Sampler, StallMeter

    ds = FileDataset("/pfs/imagenet.pack", root="train", transform=decode)
    sampler = Sampler(ds, seed=0, prefetch="512MiB")
    loader = StallMeter(DataLoader(ds, batch_size=256, sampler=sampler, num_workers=8))
    for epoch in range(90):
        sampler.set_epoch(epoch)
        for images, labels in loader:
            ...
        print(loader.last)          # this epoch's data-stall share

docs/torch.md tells the whole story (padding, locality bound, resume, prefetching).
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "stagefs.torch needs PyTorch, which is not installed: pip install 'stagefs[torch]' "
        "(or pip install torch)"
    ) from exc

from stagefs.torch._dataset import FileDataset
from stagefs.torch._prefetch import Prefetcher
from stagefs.torch._sampler import Sampler
from stagefs.torch._stall import EpochStall, StallMeter

__all__ = ["EpochStall", "FileDataset", "Prefetcher", "Sampler", "StallMeter"]
