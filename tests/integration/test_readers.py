"""Real readers through ``stagefs run``: TensorFlow (tf.data over TFRecord files found with
tf.io.gfile.glob), h5py, pyarrow and pandas parquet, PIL, np.load with and without mmap, and
DLIO's npz / hdf5 / jpeg / tfrecord reader classes each read a packed tree served at a path
that does not exist on disk, and must get exactly what they get from the real tree
(reader_probe.py is the reader; the real tree is the oracle).

The readers that open files from C (h5py, TensorFlow, pyarrow) are served only by the
preload library that ``stagefs run`` loads; the ones that open files from Python are served
by the Python-level interception as well. A reader skips only when its package is absent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from reader_probe import NEEDS, missing

import stagefs

pytestmark = [pytest.mark.integration, pytest.mark.slow]
PROBE = str(Path(__file__).resolve().parent / "reader_probe.py")


def _run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False,
                          env=env)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tree (written by the probe, in a process of its own), its pack, a tier, and the
    environment the readers run in."""
    base = tmp_path_factory.mktemp("readers")
    env = dict(os.environ, STAGEFS_RUNTIME=str(base / "runtime"), TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("STAGEFS_TIERS", None)
    r = _run([sys.executable, PROBE, "build", str(base / "src")], env)
    assert r.returncode == 0, r.stderr
    stagefs.pack(base / "src", base / "pack", shard_size="8MiB", jobs=1, progress=False,
                 echo=lambda _m: None)
    return {"src": base / "src", "pack": base / "pack", "tier": base / "tier",
            "at": base / "lustre" / "dataset", "env": env, "plain": {}}


def read(served: dict[str, Any], reader: str, *, staged: bool) -> Any:
    """What ``reader`` reads from the real tree, or from the pack through ``stagefs run``."""
    if not staged:
        if reader not in served["plain"]:
            r = _run([sys.executable, PROBE, reader, str(served["src"])], served["env"])
            assert r.returncode == 0, f"{reader} on the real tree failed:\n{r.stderr}"
            served["plain"][reader] = json.loads(r.stdout)
        return served["plain"][reader]
    at = str(served["at"])
    r = _run([sys.executable, "-m", "stagefs", "run", "--dataset", str(served["pack"]),
              "--at", at, "--tier", str(served["tier"]), "--",
              sys.executable, PROBE, reader, at], served["env"])
    assert r.returncode == 0, f"{reader} through stagefs run failed:\n{r.stderr[-3000:]}"
    return json.loads(r.stdout)


def needs(reader: str) -> None:
    gone = missing(reader)
    if gone:
        pytest.skip(f"{', '.join(gone)} not installed (pip install 'stagefs[readers]')")


def test_the_served_path_is_not_on_disk(served: dict[str, Any]) -> None:
    """Every answer below comes from the pack: nothing is at --at to fall back on."""
    assert not os.path.lexists(served["at"])


@pytest.mark.parametrize("reader", sorted(set(NEEDS) - {"npy_mmap"}))
def test_reader_gets_the_original(served: dict[str, Any], reader: str) -> None:
    needs(reader)
    plain = read(served, reader, staged=False)
    assert plain, reader  # the probe fails on an empty result; this is the record it made
    assert read(served, reader, staged=True) == plain


def test_tf_data_reads_every_record(served: dict[str, Any]) -> None:
    """A glob that finds no file makes training run zero steps, silently: the probe fails
    then, and the counts here are those of the real files."""
    needs("tfdata")
    from reader_probe import TF_FILES, TF_RECORDS

    got = read(served, "tfdata", staged=True)
    assert len(got["files"]) == TF_FILES and got["records"] == TF_FILES * TF_RECORDS


def test_np_load_mmap_maps_instead_of_copying(served: dict[str, Any]) -> None:
    """np.load(mmap_mode='r') of a staged 32 MiB file: the same array, and reading all of it
    costs the process far less memory of its own than the file (a copy, in anonymous memory
    or a memory file, costs the whole file; a mapping of the tier's copy nothing). Memory is
    measured, not time."""
    plain = read(served, "npy_mmap", staged=False)
    staged = read(served, "npy_mmap", staged=True)
    assert staged["array"] == plain["array"]
    assert staged["array"][3] == "memmap"
    size = plain["file_size"]
    assert plain["growth"] < size // 8, plain
    # a copy costs the whole file; a mapping costs the reader's buffers (the header read
    # and the pieces verified as they are mapped: a few MiB whatever the file's size)
    assert staged["growth"] < size // 4, (
        f"reading a mapped {size}-byte file took {staged['growth']} bytes of the process's "
        f"own memory (its pages map {staged['backing']}): it was copied, not mapped")
