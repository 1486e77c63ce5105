"""``stagefs bench`` when things go wrong: flags naming odd places, systems that fail or
cannot run, Ctrl-C. What is asserted is what the user is left with: the directories given
kept, nothing of the run's left behind, a clear error before the work rather than after,
and a failure reported as one (in the table and in the exit status), never as a success."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from stagefs.bench import runner, systems
from stagefs.bench.base import Context, write_index
from stagefs.bench.report import write_report
from stagefs.cli import main

pytestmark = pytest.mark.integration

TINY = ["bench", "--files", "4", "--epochs", "1", "--runs", "1", "--no-drop-caches"]


def _results(out: Path) -> dict[str, Any]:
    with open(out / "results.json") as f:
        return dict(json.load(f))


def test_existing_local_and_work_dirs_are_kept(tmp_path: Path) -> None:
    """--local /dev/shm must not empty /dev/shm: the run removes only what it made."""
    local, work = tmp_path / "local", tmp_path / "work"
    for d in (local, work):
        d.mkdir()
        (d / "keep").write_text("precious")
    rc = main([*TINY, "--origin", str(tmp_path / "o"), "--out", str(tmp_path / "r"),
               "--systems", "plain-local", "stagefs-native",
               "--local", str(local), "--work", str(work)])
    assert rc == 0
    for d in (local, work):
        assert sorted(os.listdir(d)) == ["keep"], d
        assert (d / "keep").read_text() == "precious"
    where = _results(tmp_path / "r")["where"]
    assert os.path.dirname(where["local"]) == str(local)  # a directory of its own in it
    assert os.path.dirname(where["conversions"]) == str(work)


def test_a_setup_error_names_the_flag_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # where the dataset is generated
    (tmp_path / "file").write_text("x")
    rc = main([*TINY, "--out", str(tmp_path / "r"), "--systems", "plain-local",
               "--local", str(tmp_path / "local"), "--work", str(tmp_path / "file" / "w")])
    assert rc == 1
    assert "--work" in capsys.readouterr().err
    assert os.listdir(temp) == []  # the generated dataset is removed
    assert not (tmp_path / "local").exists()
    assert not (tmp_path / "r").exists()  # no report, no empty report directory


def test_an_interrupted_generation_leaves_no_partial_dataset(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A later run would take the files written so far for the dataset."""
    from stagefs.bench import datasets

    def interrupted(root: str, **_: Any) -> None:
        os.makedirs(os.path.join(root, "train"))
        Path(root, "train", "img_0.JPEG").write_bytes(b"x" * 100)
        raise KeyboardInterrupt

    monkeypatch.setattr(datasets, "imagenet_like", interrupted)
    origin = tmp_path / "o"
    assert main([*TINY, "--origin", str(origin), "--out", str(tmp_path / "r")]) == 130
    assert not origin.exists()
    origin.mkdir()  # an empty directory given: kept, and left empty
    assert main([*TINY, "--origin", str(origin), "--out", str(tmp_path / "r")]) == 130
    assert os.listdir(origin) == []


@pytest.mark.parametrize("err, words", [
    (errno.ENOSPC, "they need about 429.7 KiB: free space there, or name another directory"),
    (errno.EROFS, "name a directory you can write with --origin"),
])
def test_a_generation_the_origin_has_no_room_for_names_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        err: int, words: str) -> None:
    """A full (or read-only) file system at --origin: the flag and what to do, not a bare
    "[Errno 28] No space left on device"; and nothing of the dataset left there."""
    from stagefs.bench import datasets

    def full(root: str, **_: Any) -> None:
        os.makedirs(os.path.join(root, "train"))
        Path(root, "train", "img_0.JPEG").write_bytes(b"x" * 100)
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(datasets, "imagenet_like", full)
    origin = tmp_path / "o"
    assert main([*TINY, "--origin", str(origin), "--out", str(tmp_path / "r")]) == 1
    msg = capsys.readouterr().err
    assert f"--origin {origin}: generating 4 imagenet-like files there failed" in msg, msg
    assert words in msg, msg
    assert not origin.exists() and not (tmp_path / "r").exists()


@pytest.mark.parametrize("kind", ["file", "origin-file"])
def test_out_or_origin_a_file_is_refused_before_any_work(
        tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "f"
    f.write_text("x")
    args = (["--out", str(f), "--origin", str(tmp_path / "o")] if kind == "file"
            else ["--out", str(tmp_path / "r"), "--origin", str(f)])
    assert main([*TINY, "--systems", "plain-local", *args]) == 1
    out = capsys.readouterr()
    assert ("--out" if kind == "file" else "--origin") in out.err
    assert "converting" not in out.err
    assert f.read_text() == "x"


def test_a_missing_peer_python_is_refused_before_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main([*TINY, "--origin", str(tmp_path / "o"), "--out", str(tmp_path / "r"),
               "--systems", "plain-local", "webdataset",
               "--peer-python", str(tmp_path / "nope" / "python")])
    assert rc == 1
    out = capsys.readouterr()
    assert "--peer-python" in out.err and "generating" not in out.err
    assert not (tmp_path / "o").exists()
    assert not (tmp_path / "r").exists()  # no empty report directory either


def test_systems_asked_for_that_cannot_run_fail_the_bench(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake = tmp_path / "python"  # a "Python" without the peers (nor anything else)
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    rc = main([*TINY, "--origin", str(tmp_path / "o"), "--out", str(tmp_path / "r"),
               "--systems", "webdataset", "litdata", "--peer-python", str(fake)])
    assert rc == 1
    err = capsys.readouterr().err
    assert "webdataset could not run" in err and "--peer-python" in err
    assert "no system ran" in err
    assert set(_results(tmp_path / "r")["skipped"]) == {"webdataset", "litdata"}


def test_a_failed_conversion_is_a_failed_row(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    real = runner._Worker.call

    def call(self: Any, system: Any, op: str, **kw: Any) -> dict[str, Any]:
        if op == "convert" and system.name == "stagefs-native":
            return {"error": "DestinationFullError: no space left"}
        return real(self, system, op, **kw)

    monkeypatch.setattr(runner._Worker, "call", call)
    out = tmp_path / "r"
    rc = main([*TINY, "--origin", str(tmp_path / "o"), "--out", str(out),
               "--systems", "plain-local", "stagefs-native"])
    assert rc == 1
    assert "stagefs-native failed: conversion failed" in capsys.readouterr().err
    table = (out / "table.md").read_text()
    assert "| stagefs-native " in table and "error: conversion failed" in table
    res = _results(out)
    assert "stagefs-native" not in res["skipped"]
    assert res["summary"]["stagefs-native"]["error"].startswith("conversion failed")


def test_a_run_that_failed_is_said_beside_the_medians_of_the_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    real = runner._Worker.call

    def call(self: Any, system: Any, op: str, **kw: Any) -> dict[str, Any]:
        if op == "run" and kw.get("run") == 1:
            return {"error": "RuntimeError: injected"}
        return real(self, system, op, **kw)

    monkeypatch.setattr(runner._Worker, "call", call)
    out = tmp_path / "r"
    rc = main(["bench", "--files", "4", "--epochs", "1", "--runs", "2", "--no-drop-caches",
               "--origin", str(tmp_path / "o"), "--out", str(out), "--systems", "plain-local"])
    assert rc == 1
    assert "plain-local: 1 of 2 runs failed" in capsys.readouterr().err
    row = next(r for r in (out / "table.md").read_text().splitlines()
               if r.startswith("| plain-local"))
    assert "1 of 2 runs failed" in row
    assert _results(out)["summary"]["plain-local"]["failed_runs"] == 1


def test_a_system_named_twice_runs_once_a_run(tmp_path: Path) -> None:
    out = tmp_path / "r"
    assert main([*TINY, "--origin", str(tmp_path / "o"), "--out", str(out),
                 "--systems", "plain-local", "plain-local"]) == 0
    res = _results(out)
    assert len(res["systems"]["plain-local"]["epochs"]) == 1
    assert res["order"] == ["plain-local"]


def test_an_earlier_runs_plots_are_not_left_as_this_runs(tmp_path: Path) -> None:
    (tmp_path / "throughput.png").write_text("an earlier run's")
    results = {"dataset": {"kind": "npz", "root": "/x", "files": 1, "bytes": 1},
               "epochs": 1, "runs": 1, "cold": "-", "systems": {}, "skipped": {}}
    write_report(results, str(tmp_path))
    assert not (tmp_path / "throughput.png").exists()


def test_ctrl_c_while_the_fuse_server_starts_stops_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import stagefs.posix.fuse as fuse

    started: list[subprocess.Popen[bytes]] = []
    real = subprocess.Popen

    def popen(cmd: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        # a stand-in server that waits to be stopped, as one that has not mounted yet does
        started.append(real([sys.executable, "-c", "import time; time.sleep(60)"],
                                        **kw))
        return started[-1]

    interrupted: list[bool] = []

    def is_mounted(path: str) -> bool:
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt
        return False

    monkeypatch.setattr(systems.subprocess, "Popen", popen)
    monkeypatch.setattr(fuse, "is_mounted", is_mounted)
    ctx = Context(raw=str(tmp_path), conv=str(tmp_path), local=str(tmp_path),
                  index=str(tmp_path / "index"), fuse_mount=str(tmp_path / "mnt"))
    try:
        with pytest.raises(KeyboardInterrupt):
            systems.serve_fuse(ctx, str(tmp_path / "stats.json"))
        assert started and started[0].poll() is not None  # stopped, not left running
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_ctrl_c_after_a_run_keeps_the_runs_that_ended(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Hours of runs on a real shared file system are not lost to one Ctrl-C: the epochs
    that ended are reported, the report says it is incomplete, and the exit is still 130."""
    real = runner._Worker.call

    def call(self: Any, system: Any, op: str, **kw: Any) -> dict[str, Any]:
        if op == "run" and kw.get("run") == 1:
            raise KeyboardInterrupt
        return real(self, system, op, **kw)

    monkeypatch.setattr(runner._Worker, "call", call)
    out = tmp_path / "r"
    rc = main(["bench", "--files", "4", "--epochs", "1", "--runs", "3", "--no-drop-caches",
               "--origin", str(tmp_path / "o"), "--out", str(out), "--systems", "plain-local"])
    assert rc == 130
    assert f"reported in {out}" in capsys.readouterr().err
    res = _results(out)
    assert res["interrupted"].startswith("stopped by Ctrl-C during run 2 of 3")
    assert len(res["systems"]["plain-local"]["epochs"]) == 1
    assert res["systems"]["plain-local"]["all_samples_once"]
    assert (out / "table.md").read_text().startswith("**Incomplete: stopped by Ctrl-C")


def test_ctrl_c_before_any_epoch_ended_writes_no_report(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def call(self: Any, system: Any, op: str, **kw: Any) -> dict[str, Any]:
        if op == "run":
            raise KeyboardInterrupt
        return real(self, system, op, **kw)

    real = runner._Worker.call
    monkeypatch.setattr(runner._Worker, "call", call)
    out = tmp_path / "r"
    rc = main(["bench", "--files", "4", "--epochs", "1", "--runs", "2", "--no-drop-caches",
               "--origin", str(tmp_path / "o"), "--out", str(out), "--systems", "plain-local"])
    assert rc == 130
    assert not out.exists()


def test_the_system_without_a_tier_takes_none_from_stagefs_tiers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """$STAGEFS_TIERS in the user's shell (as a training job sets it) must not give
    stagefs-native a tier: that tier, not emptied between runs, served its epochs, so the
    "no tier" row measured a tier and the cold epoch of every later run was warm."""
    env_tier = tmp_path / "users-tier"
    env_tier.mkdir()
    monkeypatch.setenv("STAGEFS_TIERS", str(env_tier))
    monkeypatch.setenv("STAGEFS_RUNTIME", str(tmp_path / "users-runtime"))
    rc = main([*TINY, "--epochs", "2", "--origin", str(tmp_path / "o"),
               "--out", str(tmp_path / "r"), "--systems", "stagefs-native"])
    assert rc == 0
    res = _results(tmp_path / "r")
    epochs = res["systems"]["stagefs-native"]["epochs"]
    assert [e["origin_bytes"] for e in epochs] == [res["dataset"]["bytes"]] * 2
    assert os.listdir(env_tier) == []


def test_a_dataset_found_at_origin_is_not_called_what_dataset_says(tmp_path: Path) -> None:
    """--dataset and --files shape a generated dataset only: the report of a run on files
    found at --origin called them "npz" because the flag said so."""
    origin = tmp_path / "o"
    origin.mkdir()
    for k in range(3):
        (origin / f"{k}.jpg").write_bytes(bytes([k]) * 100)
    rc = main([*TINY, "--dataset", "npz", "--origin", str(origin), "--out", str(tmp_path / "r"),
               "--systems", "plain-origin"])
    assert rc == 0
    assert _results(tmp_path / "r")["dataset"] == {
        "kind": "existing", "root": str(origin), "files": 3, "bytes": 300}
    assert (tmp_path / "r" / "table.md").read_text().startswith("3 existing files")
    assert sorted(os.listdir(origin)) == ["0.jpg", "1.jpg", "2.jpg"]


def test_a_local_copy_that_does_not_fit_leaves_no_part_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--local too small for plain-local's copy: the part copied filled it, so the worker
    could not write its own error, and every system after it was "left out" with a
    traceback, then the bench ended on a bare "[Errno 28]". The part is removed."""
    ctx = Context(raw=str(tmp_path / "raw"), conv=str(tmp_path / "conv"),
                  local=str(tmp_path / "local"), index=str(tmp_path / "index"))
    write_index(ctx.index, [("a/0.jpg", 100), ("a/1.jpg", 100)])

    def full(src: str, dest: str, **_: Any) -> None:
        Path(dest).write_bytes(b"x" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), dest)

    monkeypatch.setattr(systems.shutil, "copyfile", full)
    with pytest.raises(OSError):
        systems.PlainLocal().convert(ctx)
    assert not os.path.exists(ctx.scratch("plain-local"))


def _tree(root: Path, files: int = 3) -> None:
    (root / "a").mkdir(parents=True)
    for k in range(files):
        (root / "a" / f"f{k}.bin").write_bytes(bytes([k]) * (100 + k))


def test_names_that_are_not_utf8_are_read_by_every_system(tmp_path: Path) -> None:
    """A file name that is not UTF-8 ended the bench in a UnicodeEncodeError traceback
    (the index of the files, then each epoch's checksum)."""
    origin = tmp_path / "o"
    _tree(origin)
    with open(os.path.join(os.fsencode(origin), b"a", b"caf\xe9 x.bin"), "wb") as f:
        f.write(b"y" * 50)
    rc = main([*TINY, "--origin", str(origin), "--out", str(tmp_path / "r"),
               "--systems", "plain-origin", "stagefs-native"])
    res = _results(tmp_path / "r")
    assert rc == 0, {n: s["errors"] for n, s in res["systems"].items()}
    assert res["dataset"]["files"] == 4
    for name, s in res["systems"].items():
        assert s["all_samples_once"] and s["same_bytes"], name
        assert [e["bytes"] for e in s["epochs"]] == [res["dataset"]["bytes"]], name


def test_a_fifo_or_a_dangling_link_in_the_dataset_is_left_out_and_said(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A FIFO in the dataset: plain-origin's worker waited on it until the hour's timeout
    (stagefs pack leaves it out); a symlink to nothing ended the bench on a bare ENOENT."""
    origin = tmp_path / "o"
    _tree(origin)
    os.mkfifo(origin / "a" / "pipe")
    os.symlink("nowhere", origin / "a" / "dead.bin")
    cfg = runner.BenchConfig(origin=str(origin), epochs=1, runs=1, out=str(tmp_path / "r"),
                             systems=["plain-origin", "plain-local", "stagefs-native"],
                             drop_caches=False, timeout=60)
    res = runner.run_bench(cfg)
    assert "left out 2 name(s) that are not regular files" in capsys.readouterr().err
    assert res["dataset"]["files"] == 3
    for name, s in res["systems"].items():
        assert not s["errors"] and s["all_samples_once"] and s["same_bytes"], (name, s)


def test_torch_rows_on_a_tree_imagefolder_reads_otherwise_fail_saying_why(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A file at the dataset's top and a symlink to a folder: FileDataset (ImageFolder's
    ROOT/CLASS/FILE) reads another set of files, and the bench said the torch row and the
    others "did not read every sample once with the same bytes", as if stagefs had served
    wrong bytes."""
    pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")
    origin = tmp_path / "o"
    _tree(origin)
    (origin / "top.txt").write_bytes(b"top")
    (origin / "b").mkdir()
    os.symlink("../a", origin / "b" / "dirlink")
    rc = main([*TINY, "--origin", str(origin), "--out", str(tmp_path / "r"),
               "--systems", "stagefs-native", "stagefs-torch"])
    err = capsys.readouterr().err
    assert rc == 1 and "did not read every sample once" not in err
    assert "stagefs-torch failed: ConfigError: FileDataset reads ImageFolder's" in err
    assert "top.txt" in err and "b/dirlink/f0.bin" in err
    res = _results(tmp_path / "r")
    assert res["systems"]["stagefs-native"]["same_bytes"]
    assert res["systems"]["stagefs-torch"]["epochs"] == []


def test_the_report_says_when_the_page_cache_was_not_dropped(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The origin's limit was said read with the page cache dropped when it was not, and
    the terminal never said the cold epochs were not cold."""
    rc = main([*TINY, "--origin", str(tmp_path / "o"), "--out", str(tmp_path / "r"),
               "--systems", "stagefs-native"])
    assert rc == 0
    assert "page cache NOT dropped (--no-drop-caches): a first epoch may read from memory" \
        in capsys.readouterr().err
    res = _results(tmp_path / "r")
    assert not any(p["cold"] for p in res["origin_limit"])
    table = (tmp_path / "r" / "table.md").read_text()
    assert "page cache dropped)" not in table
    assert "page cache NOT dropped, so the limit may be memory's" in table
