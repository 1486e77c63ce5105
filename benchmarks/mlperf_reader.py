"""A DLIO reader class (``reader.reader_classname=mlperf_reader.StoreNPZReader``) that reads
the unet3d workload's npz samples through a stagefs Store instead of the file system: DLIO's
PyTorch data loader, sampler, threads and AU accounting unchanged, the bytes from the pack
($STAGEFS_MLPERF_PACK) and the tiers ($STAGEFS_TIERS). A path DLIO lists under
$STAGEFS_MLPERF_ROOT is read as the same path in the pack."""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np
from dlio_benchmark.reader.npz_reader import NPZReader

import stagefs

_store: tuple[int, Any] | None = None  # (pid, Store): each DataLoader worker opens its own


def store() -> Any:
    global _store
    if _store is None or _store[0] != os.getpid():
        _store = (os.getpid(), stagefs.open(os.environ["STAGEFS_MLPERF_PACK"]))
    return _store[1]


class StoreNPZReader(NPZReader):  # type: ignore[misc]
    def open(self, filename: str) -> Any:
        rel = os.path.relpath(filename, os.environ["STAGEFS_MLPERF_ROOT"])
        return np.load(io.BytesIO(store().read(rel)), allow_pickle=True)["x"]
