"""One job reading several datasets at once (a train set and a val set) through the same
tier directories: what each holds, and what the job is told about it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import stagefs
from conftest import pack_files, random_bytes

MiB = 2**20


def test_a_tier_full_of_a_dataset_the_job_reads_is_not_called_old(
        tmp_path: Path, runtime: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The train set took the tier before the val set came: the val set's warning names
    the train set by its origin as a dataset this job reads, and does not tell to delete its
    directory (it once called the train set's copies old ones to delete)."""
    train = pack_files(tmp_path, "train", {f"t{i}.bin": random_bytes(200_000, i) for i in range(30)})
    val_files = {f"v{i}.bin": random_bytes(200_000, 100 + i) for i in range(5)}
    val = pack_files(tmp_path, "val", val_files)
    tier = f"{tmp_path / 'ram'}:3MiB"
    with stagefs.open(train, tiers=[tier]) as tr, stagefs.open(val, tiers=[tier]) as va:
        assert tr.chain is not None and va.chain is not None
        tr.chain.stage()
        train_dir = tr.chain.tiers[0].dir
        with caplog.at_level(logging.WARNING, logger="stagefs"):
            assert all(va.read(p) == d for p, d in val_files.items())
            va.chain.wait_idle(60)
    said = [r.getMessage() for r in caplog.records if "is full" in r.getMessage()]
    assert said, "no word why the val set holds nothing"
    assert not [m for m in said if train_dir in m or "delete" in m], said
    assert str(train) in said[0] and str(val) in said[0] and "of its own" in said[0]


def test_a_tier_full_of_a_dataset_another_job_reads_is_not_called_old(
        tmp_path: Path, runtime: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Another job of the user (another id, its runtime beside this one's) reads the train
    set, which took the shared tier first: the val set's warning called its copies "other
    datasets' copies" that stay "until 'stagefs clean'", and told to delete the directory
    that job was reading. It names the train set by its origin as a dataset read now."""
    train = pack_files(tmp_path, "train", {f"t{i}.bin": random_bytes(200_000, i) for i in range(30)})
    val_files = {f"v{i}.bin": random_bytes(200_000, 100 + i) for i in range(5)}
    val = pack_files(tmp_path, "val", val_files)
    tier = f"{tmp_path / 'ram'}:3MiB"
    child = textwrap.dedent("""
        import sys
        import stagefs
        with stagefs.open(sys.argv[1], tiers=[sys.argv[2]]) as fs:
            fs.chain.stage()
            print(fs.chain.tiers[0].dir, flush=True)
            sys.stdin.readline()
    """)
    env = {**os.environ, "STAGEFS_RUNTIME": str(tmp_path / "other"), "STAGEFS_JOB": "other"}
    other = subprocess.Popen([sys.executable, "-c", child, str(train), tier], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert other.stdin is not None and other.stdout is not None
    try:
        train_dir = other.stdout.readline().strip()
        assert train_dir, "the other job did not stage"
        with caplog.at_level(logging.WARNING, logger="stagefs"), \
                stagefs.open(val, tiers=[tier]) as va:
            assert va.chain is not None
            assert all(va.read(p) == d for p, d in val_files.items())
            va.chain.wait_idle(60)
    finally:
        other.communicate("done\n", timeout=60)
    assert other.returncode == 0
    said = [r.getMessage() for r in caplog.records if "is full" in r.getMessage()]
    assert said, "no word why the val set holds nothing"
    assert not [m for m in said if train_dir in m or "delete" in m], said
    assert str(train) in said[0] and "of its own" in said[0]


def test_the_full_tier_is_told_once_for_the_job_not_by_each_worker(
        tmp_path: Path, runtime: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Each DataLoader worker of each epoch opens the val set anew and finds the tier full:
    the warning was said by every one of them, two a worker an epoch for two tiers. It is
    said by the job's first process that finds it (a second store stands for the next
    worker), and the reads go on as before."""
    train = pack_files(tmp_path, "train", {f"t{i}.bin": random_bytes(200_000, i) for i in range(30)})
    val_files = {f"v{i}.bin": random_bytes(200_000, 100 + i) for i in range(5)}
    val = pack_files(tmp_path, "val", val_files)
    tier = f"{tmp_path / 'ram'}:3MiB"
    with stagefs.open(train, tiers=[tier]) as tr:
        assert tr.chain is not None
        tr.chain.stage()
        with caplog.at_level(logging.WARNING, logger="stagefs"):
            for _epoch in range(3):
                with stagefs.open(val, tiers=[tier]) as va:
                    assert va.chain is not None
                    assert all(va.read(p) == d for p, d in val_files.items())
                    va.chain.wait_idle(60)
                    assert va.chain.tiers[0].stopped == "full"
    said = [r.getMessage() for r in caplog.records if "is full" in r.getMessage()]
    assert len(said) == 1, said


def test_status_shows_each_dataset_reads_and_hit_rate_apart(
        tmp_path: Path, runtime: Path) -> None:
    """A train set held whole and a val set the tier has no room left for: the job's hit
    rate mixes them; ``stagefs status`` shows each dataset's samples, origin bytes and hit
    rate apart, and the job's totals are their sums."""
    from stagefs.runtime import Runtime
    from stagefs.tiers.status import job_status, read_lines

    train_files = {f"t{i}.bin": random_bytes(100_000, i) for i in range(10)}
    val_files = {f"v{i}.bin": random_bytes(100_000, 100 + i) for i in range(4)}
    train = pack_files(tmp_path, "train", train_files)
    val = pack_files(tmp_path, "val", val_files)
    tier = f"{tmp_path / 'ram'}:1010KiB"  # the train set and its copy's header: 1002 KiB
    with stagefs.open(train, tiers=[tier]) as tr, stagefs.open(val, tiers=[tier]) as va:
        assert tr.chain is not None
        tr.chain.stage()
        for _epoch in range(2):
            assert tr.read_many(sorted(train_files)) == [train_files[p] for p in
                                                        sorted(train_files)]
            assert all(va.read(p) == d for p, d in val_files.items())
    st = job_status(Runtime(str(runtime)))
    by = {d["origin"]: d for d in st["datasets"]}
    assert set(by) == {str(train), str(val)}
    assert by[str(train)]["reads"] == 20 and by[str(train)]["hit_rate"] > 0.4
    assert by[str(val)]["reads"] == 8 and by[str(val)]["hit_rate"] == 0.0
    assert by[str(val)]["holders"]["origin"]["reads"] == 8
    assert st["reads"] == 28 and st["fetched"]["bytes"] == sum(
        d["fetched"]["bytes"] for d in st["datasets"])
    text = "\n".join(read_lines(st, "every process of the job"))
    assert "reads by dataset" in text and str(val) in text and str(train) in text
