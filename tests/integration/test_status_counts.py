"""`stagefs status` counts every read of the job, per sample and per byte, by holder, from
every process: forked DataLoader workers (which leave with os._exit) and a FUSE server."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import stagefs
from stagefs.config import format_size as _size
from stagefs.posix.fuse import fuse_available, is_mounted
from tiers_helpers import make_tree

pytestmark = pytest.mark.integration


def _stagefs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stagefs.cli", *args], capture_output=True,
                          text=True, timeout=120, check=False)


def status(rt: Path) -> dict[str, Any]:
    r = _stagefs("status", "--runtime", str(rt), "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    base = tmp_path_factory.mktemp("counts")
    files = {p: d for p, d in make_tree(base / "raw", n=150).items() if d}
    stagefs.pack(base / "raw", base / "pack", shard_size="64KiB", jobs=1, progress=False,
                 echo=lambda _m: None)
    return base / "pack", files


def test_forked_dataloader_workers_are_counted(dataset: tuple[Path, dict[str, bytes]],
                                               tmp_path: Path) -> None:
    """Two epochs of a DataLoader with two forked workers (batched reads: read_many): the
    job's status counts each sample and byte once, the first epoch from the origin, the
    second from the tier."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")
    from stagefs.torch import FileDataset

    pack, files = dataset
    rt, tier = tmp_path / "rt", tmp_path / "tier"
    samples = total = 0
    with stagefs.open(pack, tiers=[str(tier)], runtime=str(rt)) as fs:
        stored = int(fs.manifest.arrays["stored"].sum())
        m = fs.manifest
        empty = sum(1 for e in range(len(m)) if m.kind[e] == 0 and not m.size[e])
        ds = FileDataset(fs, root="")
        loader = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=True, num_workers=2,
                                             multiprocessing_context="fork",
                                             collate_fn=lambda b: b, timeout=120)
        for epoch in range(2):
            for batch in loader:
                samples += len(batch)  # an empty file too: a sample of no bytes
                total += sum(len(data) for data, _ in batch)
            st = status(rt)
            # the workers' streams and reads took every stored byte from the origin once,
            # in the first epoch: a cold epoch is no hit, whoever served its samples
            assert st["fetched"]["bytes"] == stored, st
            assert st["hit_rate"] == pytest.approx(epoch / (epoch + 1)), st
        assert fs.stats.reads == 0  # the workers read, not this process
    assert empty and samples == 2 * (len(files) + empty)
    assert (st["reads"], st["bytes"]) == (samples, total), st
    held = st["holders"]
    # the empty files from memory (the manifest answers them), no bytes
    assert held["memory"]["reads"] >= 2 * empty
    tiered = held["memory"]["bytes"] + held["disk"]["bytes"]
    assert held["origin"]["bytes"] + tiered == total
    assert tiered >= total // 2  # the second epoch came from the tier
    assert st["unavailable"] == 0  # the tiers and the stream hand reads on: no failure


@pytest.mark.skipif(fuse_available() is not None, reason=str(fuse_available()))
def test_fuse_reads_are_counted(dataset: tuple[Path, dict[str, bytes]],
                                tmp_path: Path) -> None:
    """Every file read once through a mount with a tier: the server's reads show in the
    job's status, byte for byte."""
    pack, files = dataset
    rt, tier, mp = tmp_path / "rt", tmp_path / "tier", tmp_path / "mnt"
    mp.mkdir()
    r = _stagefs("mount", str(pack), str(mp), "--tier", str(tier), "--runtime", str(rt))
    assert r.returncode == 0, r.stderr
    try:
        for rel, data in files.items():
            with open(mp / rel, "rb") as f:
                assert f.read() == data
    finally:
        r = _stagefs("umount", str(mp))
        assert r.returncode == 0, r.stderr
    assert not is_mounted(str(mp))
    st = status(rt)
    assert st["bytes"] == sum(len(d) for d in files.values()), st
    assert st["reads"] == len(files)
    assert os.listdir(rt / "stats")


@pytest.mark.skipif(fuse_available() is not None, reason=str(fuse_available()))
def test_a_cold_fuse_read_of_a_file_read_whole_is_one_sample(tmp_path: Path) -> None:
    """`cat` of files of 1-4 MiB (and a compressed one over 4 MiB), read whole by the server,
    through a cold mount with a tier: one sample each and its bytes. The kernel asks for
    such a file in two or more READs at once; each read and counted it (two samples)."""
    rng = random.Random(21)
    files = {"a.bin": rng.randbytes(2 * 2**20 - 1), "b.bin": rng.randbytes(4 * 2**20),
             "c.bin": rng.randbytes(2**20 + 1),
             "t.txt": b"".join(b"line %d\n" % rng.randrange(10**9) for _ in range(400_000))}
    raw, rt, tier, mp = tmp_path / "raw", tmp_path / "rt", tmp_path / "tier", tmp_path / "mnt"
    raw.mkdir()
    mp.mkdir()
    for name, data in files.items():
        (raw / name).write_bytes(data)
    stagefs.pack(raw, tmp_path / "pack", shard_size="1MiB", jobs=1, progress=False,
                 echo=lambda _m: None)
    with stagefs.open(tmp_path / "pack") as fs:
        assert fs.manifest.codec[fs.namespace.file_entry("t.txt")]  # read whole too
    assert len(files["t.txt"]) > 4 * 2**20
    r = _stagefs("mount", str(tmp_path / "pack"), str(mp), "--tier", str(tier),
                 "--runtime", str(rt))
    assert r.returncode == 0, r.stderr
    try:
        for name, data in files.items():
            got = subprocess.run(["cat", name], cwd=mp, capture_output=True, timeout=120,
                                 check=True).stdout
            assert got == data
    finally:
        r = _stagefs("umount", str(mp))
        assert r.returncode == 0, r.stderr
    st = status(rt)
    assert (st["reads"], st["bytes"]) == (len(files), sum(map(len, files.values()))), st


def test_a_program_under_stagefs_run_is_counted_and_downloads_once(
        dataset: tuple[Path, dict[str, bytes]], tmp_path: Path) -> None:
    """`cat` of every file twice under `stagefs run` with a memory-or-disk tier: the first
    run's reads go through the helper (the Store's cold path: one download shared with the
    stream placing the shards), the second's straight to the tier copies from the preload
    library; status counts every sample and byte of both, and the origin gave each stored
    byte once."""
    from stagefs._native import preload_library

    if preload_library() is None:
        pytest.skip("the preload library is not built (no C compiler at install)")
    pack, files = dataset
    rt, tier, at = tmp_path / "rt", tmp_path / "tier", tmp_path / "data"
    names = sorted(files)
    script = "for f in \"$@\"; do cat \"$f\"; done | md5sum"
    env = dict(os.environ, STAGEFS_RUNTIME=str(rt))
    want = subprocess.run(["sh", "-c", script, "sh", *names], capture_output=True, text=True,
                          check=True, cwd=pack.parent / "raw").stdout
    for _ in range(2):
        r = subprocess.run([sys.executable, "-m", "stagefs.cli", "run", "--dataset", str(pack),
                            "--at", str(at), "--tier", str(tier), "--", "sh", "-c",
                            f"cd '{at}' && {script}", "sh", *names],
                           capture_output=True, text=True, timeout=120, env=env, check=False)
        assert r.returncode == 0, r.stderr
        assert r.stdout == want
    st = status(rt)
    total = sum(len(d) for d in files.values())
    assert (st["reads"], st["bytes"]) == (2 * len(files), 2 * total), st
    held = st["holders"]
    assert held["memory"]["reads"] + held["disk"]["reads"] >= len(files)  # the second run
    with stagefs.open(pack) as fs:
        stored = sum(s.size for s in fs.manifest.shards)
    assert sum(o["bytes_read"] for o in st["origins"]) <= stored  # one download


def test_a_large_file_read_in_parts_is_one_sample_and_a_compressed_one_weighs_as_stored(
        tmp_path: Path) -> None:
    """A file read through a file object in many ranges (as a FUSE mount's 1 MiB requests
    read it) is one sample and all its bytes; a range that does not start the file adds
    bytes, no sample. The hit rate weighs the origin's reads against the samples' stored
    bytes: a cold epoch of compressible files is no hit though it delivered more bytes than
    the origin gave."""
    from stagefs.fileobj import WHOLE_READ_LIMIT

    raw, rt = tmp_path / "raw", tmp_path / "rt"
    raw.mkdir()
    big = os.urandom(WHOLE_READ_LIMIT + 3 * 2**20 + 17)
    (raw / "big.bin").write_bytes(big)
    texts = {f"t{k}.txt": (f"line {k} " * 4000).encode() for k in range(20)}
    for name, data in texts.items():
        (raw / name).write_bytes(data)
    stagefs.pack(raw, tmp_path / "pack", jobs=1, progress=False, echo=lambda _m: None)
    with stagefs.open(tmp_path / "pack", tiers=[str(tmp_path / "tier")], runtime=str(rt)) as fs:
        assert fs.manifest.arrays["stored"].sum() < len(big) + sum(map(len, texts.values()))
        with fs.open("big.bin", buffering=2**20) as f:
            parts = iter(lambda: f.read(2**20), b"")
            assert b"".join(parts) == big
        assert fs.read_many(sorted(texts)) == [texts[n] for n in sorted(texts)]
        st = status(rt)
        assert st["reads"] == 1 + len(texts), st
        assert st["bytes"] == len(big) + sum(map(len, texts.values()))
        assert st["hit_rate"] == 0, st  # every byte came from the origin, once
        assert st["stored_bytes"] == int(fs.manifest.arrays["stored"].sum()) < st["bytes"]
        line = _stagefs("status", "--runtime", str(rt)).stdout
        assert f"({_size(st['stored_bytes'])} as stored, compressed)" in line
        assert "hit rate 0.0% (the stored bytes read that were not read" in line
        e = fs.namespace.file_entry("big.bin")
        assert fs.read_entry(e, start=5, length=10) == big[5:15]
    again = status(rt)
    assert (again["reads"], again["bytes"]) == (st["reads"], st["bytes"] + 10)
    assert again["fetched"] == st["fetched"] and again["hit_rate"] > 0  # from the tier
    # a file object is one sample whatever it reads: its second half (it counted none), or
    # all of it twice over (it counted two)
    with stagefs.open(tmp_path / "pack", tiers=[str(tmp_path / "tier")], runtime=str(rt)) as fs:
        with fs.open("big.bin") as f:
            f.seek(len(big) // 2)
            assert f.read() == big[len(big) // 2 :]
        assert status(rt)["reads"] == again["reads"] + 1
        with fs.open("big.bin") as f:
            assert f.read() == big
            f.seek(0)
            assert f.read(1000) == big[:1000]
        assert status(rt)["reads"] == again["reads"] + 2


def test_the_tier_bytes_a_stream_wrote_are_not_said_to_be_the_reads(
        dataset: tuple[Path, dict[str, bytes]], tmp_path: Path) -> None:
    """Shards handed to Store.prefetch are streamed into a tier with no sample read; the
    status table said those bytes were "filled by reads"."""
    pack, _ = dataset
    rt = tmp_path / "rt"
    with stagefs.open(pack, tiers=[str(tmp_path / "tier")], runtime=str(rt)) as fs:
        n = len(fs.manifest.shards)
        fs.prefetch(range(n))
        chain = fs.chain
        assert chain is not None
        for _ in range(6000):  # the streams end (well within a minute)
            if len(fs.held_shards()) == n:
                break
            threading.Event().wait(0.01)
        assert len(fs.held_shards()) == n
    st = status(rt)
    assert st["reads"] == 0 and st["tiers"][0]["filled_bytes"] > 0, st
    r = _stagefs("status", "--runtime", str(rt))
    assert r.returncode == 0, r.stderr
    assert "by reads" not in r.stdout and "filled (streams, reads, staging)" in r.stdout, r.stdout


def test_an_empty_file_is_a_sample_of_no_bytes(tmp_path: Path) -> None:
    """An empty file read (``read``, ``read_many``, a file object) is one sample of no
    bytes, from memory (the manifest answers it); it was not counted at all."""
    raw, rt = tmp_path / "raw", tmp_path / "rt"
    raw.mkdir()
    (raw / "empty").write_bytes(b"")
    (raw / "full").write_bytes(b"x" * 1000)
    stagefs.pack(raw, tmp_path / "pack", jobs=1, progress=False, echo=lambda _m: None)
    with stagefs.open(tmp_path / "pack", tiers=[str(tmp_path / "tier")], runtime=str(rt)) as fs:
        assert fs.read("empty") == b""
        assert fs.read_many(["empty", "full", "empty"]) == [b"", b"x" * 1000, b""]
        with fs.open("empty") as f:
            assert f.read() == b""
    st = status(rt)
    assert (st["reads"], st["bytes"]) == (5, 1000), st
    assert st["holders"]["memory"]["reads"] >= 4


def test_a_batch_from_the_origin_counts_its_reads_as_the_origin_saw_them(
        dataset: tuple[Path, dict[str, bytes]], tmp_path: Path) -> None:
    """``read_many`` reads runs of adjacent files with one call each (``gather``; a run cut
    where the batch is split, after its first reads and into parts, is two): the process's
    origin counter and the job's (`stagefs status`) both count those calls, not the files,
    and bytes once."""
    pack, files = dataset
    rt = tmp_path / "rt"
    # a tier too small for any shard: a job `stagefs status` shows, every read the origin's
    with stagefs.open(pack, tiers=[f"{tmp_path / 'tier'}:4KiB"], runtime=str(rt)) as fs:
        m = fs.manifest
        names = sorted(files)
        batch = names[: len(names) // 2] + names[len(names) // 2 :: 3]  # runs, and gaps
        ents = sorted((int(m.shard[m.lookup(p.encode())]), int(m.offset[m.lookup(p.encode())]),
                       int(m.stored[m.lookup(p.encode())])) for p in batch)
        runs = sum(1 for k, (s, o, _) in enumerate(ents)
                   if k == 0 or s != ents[k - 1][0] or o != ents[k - 1][1] + ents[k - 1][2])
        assert fs.read_many(batch) == [files[p] for p in batch]
        reads = fs.origin.stats.reads
        assert runs <= reads <= runs + len(os.sched_getaffinity(0)) < len(batch)
        assert fs.origin.stats.bytes_read == sum(n for _, _, n in ents)
        fs.status()  # writes this process's counters
    st = status(rt)
    assert st["fetched"] == {"reads": reads, "bytes": sum(n for _, _, n in ents)}, st


def test_an_empty_file_under_stagefs_run_is_a_sample_from_memory(tmp_path: Path) -> None:
    """`cat` of an empty file under `stagefs run`, its shard in a disk tier: a sample of no
    bytes from memory (the manifest answers it), as the Store counts it; the preload
    library counted it as the tier's (or the origin's) that held the shard."""
    from stagefs._native import preload_library

    if preload_library() is None:
        pytest.skip("the preload library is not built (no C compiler at install)")
    raw, rt, tier, at = tmp_path / "raw", tmp_path / "rt", tmp_path / "tier", tmp_path / "at"
    raw.mkdir()
    (raw / "empty").write_bytes(b"")
    (raw / "full").write_bytes(os.urandom(5000))
    stagefs.pack(raw, tmp_path / "pack", jobs=1, progress=False, echo=lambda _m: None)
    env = dict(os.environ, STAGEFS_RUNTIME=str(rt))
    for _ in range(2):  # the second time, the shard is whole in the tier
        r = subprocess.run([sys.executable, "-m", "stagefs.cli", "run", "--dataset",
                            str(tmp_path / "pack"), "--at", str(at), "--tier", str(tier),
                            "--", "cat", str(at / "full"), str(at / "empty")],
                           capture_output=True, timeout=120, env=env, check=False)
        assert r.returncode == 0, r.stderr
        assert r.stdout == (raw / "full").read_bytes()
    st = status(rt)
    assert (st["reads"], st["bytes"]) == (4, 10000), st
    assert st["holders"]["memory"] == {"reads": 2, "bytes": 0}, st


def test_a_file_mapped_under_stagefs_run_counts_its_bytes(tmp_path: Path) -> None:
    """`mmap` of staged files under `stagefs run` (what `np.load(mmap_mode="r")` does), their
    shards whole in a tier: a sample and the bytes mapped each, from the tier, as a read of
    them counts; the library checked those bytes and counted none of them."""
    from stagefs._native import preload_library

    if preload_library() is None:
        pytest.skip("the preload library is not built (no C compiler at install)")
    raw, rt, tier, at = tmp_path / "raw", tmp_path / "rt", tmp_path / "tier", tmp_path / "at"
    files = {f"f{k}.bin": os.urandom(4096 * k + 1000 * k + 7) for k in range(1, 7)}
    for name, data in files.items():
        (raw / name).parent.mkdir(exist_ok=True)
        (raw / name).write_bytes(data)
    stagefs.pack(raw, tmp_path / "pack", jobs=1, progress=False, echo=lambda _m: None,
                 compress="none")
    env = dict(os.environ, STAGEFS_RUNTIME=str(rt))
    r = subprocess.run([sys.executable, "-m", "stagefs.cli", "stage", str(tmp_path / "pack"),
                        "--tier", str(tier)], capture_output=True, timeout=120, env=env,
                       check=False)
    assert r.returncode == 0, r.stderr
    mapper = ("import mmap, os, sys\n"
              "for p in sys.argv[1:]:\n"
              "    fd = os.open(p, os.O_RDONLY)\n"
              "    m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)\n"
              "    sys.stdout.buffer.write(bytes(m)); m.close(); os.close(fd)\n")
    names = sorted(files)
    r = subprocess.run([sys.executable, "-m", "stagefs.cli", "run", "--dataset",
                        str(tmp_path / "pack"), "--at", str(at), "--tier", str(tier), "--",
                        sys.executable, "-c", mapper, *(str(at / n) for n in names)],
                       capture_output=True, timeout=120, env=env, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout == b"".join(files[n] for n in names)
    st = status(rt)
    total = sum(map(len, files.values()))
    assert (st["reads"], st["bytes"]) == (len(files), total), st
    held = st["holders"]
    assert held["memory"]["bytes"] + held["disk"]["bytes"] == total, st


def test_a_dataset_read_without_tiers_counts_for_the_job(
        dataset: tuple[Path, dict[str, bytes]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A val set read without tiers beside a train set with tiers (the job's runtime is
    there): its samples are the job's too, apart by dataset, and a copy of its store (a
    spawned DataLoader worker's) counts as well; they were not counted at all."""
    import pickle

    pack, files = dataset
    rt = tmp_path / "rt"
    raw = tmp_path / "val"
    val = {f"v{k}.bin": os.urandom(100 + k) for k in range(10)}
    for name, data in val.items():
        raw.mkdir(exist_ok=True)
        (raw / name).write_bytes(data)
    stagefs.pack(raw, tmp_path / "val.pack", jobs=1, progress=False, echo=lambda _m: None)
    monkeypatch.setenv("STAGEFS_RUNTIME", str(rt))
    names = sorted(files)[:20]
    with stagefs.open(pack, tiers=[str(tmp_path / "tier")]) as train, \
            stagefs.open(tmp_path / "val.pack") as vs:
        assert train.read_many(names) == [files[n] for n in names]
        assert vs.read_many(sorted(val)) == [val[n] for n in sorted(val)]
        copy = pickle.loads(pickle.dumps(vs))
        try:
            assert copy.read("v3.bin") == val["v3.bin"]
        finally:
            copy.close()
        vid = vs.manifest.pack_id.hex()
    st = status(rt)
    want = sum(map(len, val.values())) + len(val["v3.bin"])
    got = {d["pack_id"]: (d["reads"], d["bytes"]) for d in st["datasets"]}
    assert got.get(vid) == (len(val) + 1, want), st
    assert (st["reads"], st["bytes"]) == (len(names) + len(val) + 1,
                                          sum(len(files[n]) for n in names) + want), st
