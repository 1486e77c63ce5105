"""Real readers over a dataset tree: ``python reader_probe.py build ROOT`` writes the tree
(TFRecord files written with TensorFlow, chunked HDF5, parquet, JPEG and PNG, .npy and .npz,
and samples in the formats DLIO reads), and ``python reader_probe.py READER ROOT`` reads
it with one reader and prints, as JSON, what it read: digests of the bytes, arrays, tables
and images, and listings, with every path relative to ROOT. Run once on the real tree (the
oracle) and once on the same tree served by a front end (``stagefs run``): the two records
must be equal. Each reader runs in a process of its own, with only the packages it needs.

A reader that finds nothing (an empty glob, no record) fails: a reader served nothing must
never pass for one that read an empty dataset.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np

NPY_MMAP_BYTES = 32 * 2**20  # big enough that a copy shows plainly in the RSS
TF_FILES, TF_RECORDS = 3, 40
DLIO_FILES, DLIO_SAMPLES, DLIO_DIM = 4, 3, 32


def sha(data: bytes | memoryview | np.ndarray) -> str:  # type: ignore[type-arg]
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).tobytes()
    return hashlib.sha256(data).hexdigest()


def rel(root: str, path: str) -> str:
    return os.path.relpath(path, root)


def found(paths: list[str], what: str) -> list[str]:
    if not paths:
        raise SystemExit(f"reader_probe: no {what} found: the reader was served nothing")
    return sorted(paths)


def private_memory() -> int:
    """Resident memory that only this process holds: anonymous pages, and the pages of
    memory files (memfd) it mapped. A file read into memory, or copied into a memory file
    to be mapped, lands here; the pages of a mapped file (the original, or a tier's copy of
    a shard, shared with every process of the node) do not."""
    total, memfd = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:  # a mapping's first line: range perms ...
                memfd = len(head) >= 6 and head[5].startswith("/memfd:")
            elif (head[0] == "Rss:" and memfd) or head[0] == "Anonymous:":
                total += int(head[1]) * 1024
    return total


def backing(address: int) -> str:
    """What the mapping holding ``address`` maps (for a message only)."""
    with open("/proc/self/maps") as f:
        for line in f:
            head = line.split()
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            if lo <= address < hi:
                return head[5] if len(head) >= 6 else "anonymous memory"
    return "?"


# ------------------------------------------------------------------------------ the tree


NEEDS = {  # the packages each reader needs (to write its files, and to read them)
    "listing": (), "tfdata": ("tensorflow",), "h5py": ("h5py",), "pyarrow": ("pyarrow",),
    "pandas": ("pandas", "pyarrow"), "pil": ("PIL",), "npy": (), "npy_mmap": (),
    "dlio_npz": ("dlio_benchmark", "tensorflow", "h5py", "PIL"),
    "dlio_hdf5": ("dlio_benchmark", "tensorflow", "h5py", "PIL"),
    "dlio_jpeg": ("dlio_benchmark", "tensorflow", "h5py", "PIL"),
    "dlio_tfrecord": ("dlio_benchmark", "tensorflow", "h5py", "PIL"),
}
"""dlio_benchmark imports TensorFlow, h5py and PIL itself; its samples are written with them."""


def missing(reader: str) -> list[str]:
    import importlib.util

    return [m for m in NEEDS[reader] if importlib.util.find_spec(m) is None]


def build(root: str) -> None:
    """The tree; the parts whose writer package is absent are left out (their readers are
    skipped, naming the package)."""
    rng = np.random.default_rng(17)
    parts: list[tuple[str, Callable[[str, np.random.Generator], None]]] = [
        ("tfdata", _build_tf), ("h5py", _build_hdf5), ("pyarrow", _build_parquet),
        ("pil", _build_images), ("npy", _build_npy), ("dlio_npz", _build_dlio)]
    for reader, make in parts:
        if not missing(reader):
            make(root, np.random.default_rng(rng.integers(1 << 32)))


def _build_npy(root: str, rng: np.random.Generator) -> None:
    os.makedirs(os.path.join(root, "npy"))
    np.save(os.path.join(root, "npy", "big.npy"), rng.standard_normal(NPY_MMAP_BYTES // 8))
    np.save(os.path.join(root, "npy", "small.npy"), np.arange(1000, dtype=np.int32))
    np.savez(os.path.join(root, "npy", "pair.npz"), a=rng.integers(0, 9, (50, 7)),
             b=np.linspace(0, 1, 333))


def _tf_example(image: bytes, size: int) -> bytes:
    import tensorflow as tf

    feature = {"image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[image])),
               "size": tf.train.Feature(int64_list=tf.train.Int64List(value=[size]))}
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def _build_tf(root: str, rng: np.random.Generator) -> None:
    import tensorflow as tf

    os.makedirs(os.path.join(root, "tfrecord"))
    for i in range(TF_FILES):
        with tf.io.TFRecordWriter(os.path.join(root, "tfrecord", f"train-{i:03d}.tfrecord")) as w:
            for _ in range(TF_RECORDS):
                w.write(rng.bytes(int(rng.integers(100, 60_000))))


def _build_hdf5(root: str, rng: np.random.Generator) -> None:
    import h5py

    os.makedirs(os.path.join(root, "hdf5"))
    with h5py.File(os.path.join(root, "hdf5", "chunked.h5"), "w") as f:
        f.attrs["note"] = "chunked datasets"
        f.create_dataset("images", data=rng.integers(0, 255, (64, 48, 48), dtype=np.uint8),
                         chunks=(8, 48, 48))
        g = f.create_group("group")
        g.create_dataset("floats", data=rng.standard_normal((300, 200)).astype(np.float32),
                         chunks=(50, 40), compression="gzip")
        g.create_dataset("labels", data=np.arange(64, dtype=np.int64), chunks=(16,))


def _build_parquet(root: str, rng: np.random.Generator) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.join(root, "parquet"))
    n = 5000
    table = pa.table({"id": np.arange(n), "x": rng.standard_normal(n),
                      "label": [f"class-{int(k)}" for k in rng.integers(0, 50, n)]})
    pq.write_table(table, os.path.join(root, "parquet", "table.parquet"), row_group_size=1000)


def _build_images(root: str, rng: np.random.Generator) -> None:
    from PIL import Image

    os.makedirs(os.path.join(root, "images"))
    for i in range(3):
        pixels = rng.integers(0, 255, (64 + i, 80, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(os.path.join(root, "images", f"img{i}.jpg"), quality=90)
        Image.fromarray(pixels[..., 0]).save(os.path.join(root, "images", f"img{i}.png"))


def _build_dlio(root: str, rng: np.random.Generator) -> None:
    """Samples as DLIO reads them: npz with ``x`` (dim, dim, samples), HDF5 with ``records``
    (samples, dim, dim), one JPEG per sample, TFRecord of ``image``/``size`` examples."""
    import h5py
    import tensorflow as tf
    from PIL import Image

    d = os.path.join(root, "dlio")
    for sub in ("npz", "hdf5", "jpeg", "tfrecord", "valid"):  # DLIO wants a valid/ folder
        os.makedirs(os.path.join(d, sub))
    for i in range(DLIO_FILES):
        recs = rng.integers(0, 255, (DLIO_SAMPLES, DLIO_DIM, DLIO_DIM), dtype=np.uint8)
        np.savez(os.path.join(d, "npz", f"img_{i}_of_{DLIO_FILES}.npz"),
                 x=np.moveaxis(recs, 0, -1), y=np.zeros(DLIO_SAMPLES, dtype=np.uint8))
        with h5py.File(os.path.join(d, "hdf5", f"img_{i}_of_{DLIO_FILES}.hdf5"), "w") as f:
            f.create_dataset("records", data=recs, chunks=(1, DLIO_DIM, DLIO_DIM))
        Image.fromarray(recs[0]).save(os.path.join(d, "jpeg", f"img_{i}_of_{DLIO_FILES}.jpeg"))
        with tf.io.TFRecordWriter(os.path.join(d, "tfrecord",
                                               f"img_{i}_of_{DLIO_FILES}.tfrecord")) as w:
            for r in recs:
                w.write(_tf_example(r.tobytes(), DLIO_DIM))


# ------------------------------------------------------------------------------ readers


def read_listing(root: str) -> Any:
    out = []
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            p = os.path.join(dirpath, name)
            with open(p, "rb") as f:
                out.append([rel(root, p), os.path.getsize(p), sha(f.read())])
    return found(out, "files")  # type: ignore[arg-type]


def read_tfdata(root: str) -> Any:
    import tensorflow as tf

    files = found(tf.io.gfile.glob(os.path.join(root, "tfrecord", "*.tfrecord")), "TFRecord file")
    h, count = hashlib.sha256(), 0
    for rec in tf.data.TFRecordDataset(files):
        h.update(rec.numpy())
        count += 1
    if not count:
        raise SystemExit("reader_probe: tf.data read no record")
    return {"files": [rel(root, p) for p in files], "records": count, "sha": h.hexdigest()}


def read_h5py(root: str) -> Any:
    import h5py

    out: dict[str, Any] = {}
    with h5py.File(os.path.join(root, "hdf5", "chunked.h5"), "r") as f:
        out["attrs"] = {k: str(v) for k, v in f.attrs.items()}

        def visit(name: str, obj: Any) -> None:
            if isinstance(obj, h5py.Dataset):
                out[name] = [list(obj.shape), obj.dtype.str, list(obj.chunks or ()),
                             sha(obj[()]), sha(obj[3:5])]  # whole, and a part of 1 chunk

        f.visititems(visit)
    return out


def read_pyarrow(root: str) -> Any:
    import pyarrow.parquet as pq

    t = pq.read_table(os.path.join(root, "parquet", "table.parquet"))
    return {"rows": t.num_rows, "schema": str(t.schema),
            "columns": {c: sha(json.dumps(t.column(c).to_pylist()).encode())
                        for c in t.column_names}}


def read_pandas(root: str) -> Any:
    import pandas as pd

    df = pd.read_parquet(os.path.join(root, "parquet", "table.parquet"))
    return {"shape": list(df.shape), "sha": sha(df.to_json().encode())}


def read_pil(root: str) -> Any:
    from PIL import Image

    out = {}
    for p in found(glob.glob(os.path.join(root, "images", "*")), "image"):
        with Image.open(p) as im:
            out[rel(root, p)] = [im.format, im.mode, list(im.size), sha(im.tobytes())]
    return out


def read_npy(root: str) -> Any:
    out: dict[str, Any] = {}
    for name in ("big.npy", "small.npy"):
        a = np.load(os.path.join(root, "npy", name))
        out[name] = [list(a.shape), a.dtype.str, sha(a)]
    with np.load(os.path.join(root, "npy", "pair.npz")) as z:
        out["pair.npz"] = {k: [list(z[k].shape), sha(z[k])] for k in sorted(z.files)}
    return out


def read_npy_mmap(root: str) -> Any:
    """np.load with mmap_mode='r': the array, and how much memory of its own the process
    took to read all of it (``growth``: about 0 when the file is mapped, its size when it
    is copied), and what the array's pages map (``backing``, for messages)."""
    path = os.path.join(root, "npy", "big.npy")
    before = private_memory()
    a = np.load(path, mmap_mode="r")
    digest = sha(memoryview(a).cast("B"))  # touches every page, copies none
    grown = private_memory() - before
    return {"array": [list(a.shape), a.dtype.str, digest, type(a).__name__],
            "file_size": os.path.getsize(path), "growth": grown,
            "backing": backing(a.ctypes.data)}


def _dlio_args(files: list[str], fmt: str) -> Any:
    """DLIO's configuration, as its reader threads see it (a child of rank 0 of 1)."""
    from dlio_benchmark.common.enumerations import DataLoaderType, FormatType
    from dlio_benchmark.utils.config import ConfigArguments
    from dlio_benchmark.utils.utility import DLIOMPI

    DLIOMPI.get_instance().set_parent_values(0, 1)
    args = ConfigArguments.get_instance()
    args.format = FormatType(fmt)
    args.num_samples_per_file = 1 if fmt == "jpeg" else DLIO_SAMPLES
    args.batch_size, args.read_threads, args.computation_threads = 1, 1, 1
    args.record_length = DLIO_DIM * DLIO_DIM
    args.data_loader = DataLoaderType.TENSORFLOW if fmt == "tfrecord" else DataLoaderType.PYTORCH
    args.epochs = 1
    args.derive_configurations(file_list_train=list(files), file_list_eval=[])
    args.reconfigure(0)
    return args


def read_dlio(root: str, fmt: str) -> Any:
    """DLIO's own reader class for ``fmt`` opens every file and reads every sample, as its
    data loader does; what its ``open`` returns is digested."""
    from dlio_benchmark.common.enumerations import DatasetType

    files = found(glob.glob(os.path.join(root, "dlio", fmt, f"*.{fmt}")), f"DLIO {fmt} file")
    args = _dlio_args(files, fmt)
    cls = _dlio_reader(fmt)
    reader = cls(DatasetType.TRAIN, 0, 0)
    out: dict[str, Any] = {"files": [rel(root, p) for p in files]}
    if fmt == "tfrecord":
        batches = sum(1 for _ in reader.next())
        out["batches"] = batches  # the reader opens every file; a missing one raises
        return out
    for p in files:
        got = reader.open(p)
        data = got["records"][()] if fmt == "hdf5" else got
        out[rel(root, p)] = [list(data.shape), sha(np.asarray(data))]
        reader.open_file_map[p] = got
        reader.close(p)
        reader.open_file_map[p] = None
    n = 0
    for index in sorted(args.train_global_index_map):  # every sample, through get_sample
        reader.read_index(index, 1)
        n += 1
    out["samples"] = n
    return out


def _dlio_reader(fmt: str) -> Any:
    if fmt == "npz":
        from dlio_benchmark.reader.npz_reader import NPZReader
        return NPZReader
    if fmt == "hdf5":
        from dlio_benchmark.reader.hdf5_reader import HDF5Reader
        return HDF5Reader
    if fmt == "jpeg":
        from dlio_benchmark.reader.image_reader import ImageReader
        return ImageReader
    from dlio_benchmark.reader.tf_reader import TFReader
    return TFReader


READERS: dict[str, Callable[[str], Any]] = {
    "listing": read_listing, "tfdata": read_tfdata, "h5py": read_h5py,
    "pyarrow": read_pyarrow, "pandas": read_pandas, "pil": read_pil, "npy": read_npy,
    "npy_mmap": read_npy_mmap,
    **{f"dlio_{fmt}": (lambda root, fmt=fmt: read_dlio(root, fmt))  # type: ignore[misc]
       for fmt in ("npz", "hdf5", "jpeg", "tfrecord")},
}


def main(argv: list[str]) -> None:
    what, root = argv
    if what == "build":
        build(root)
        return
    json.dump(READERS[what](root), sys.stdout, sort_keys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
