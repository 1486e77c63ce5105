"""`stagefs status` shows the data stall that training processes recorded in the runtime."""

from __future__ import annotations

import json
from pathlib import Path

import stagefs
from stagefs.cli import main


def _tiny_pack(tmp_path: Path, n: int) -> None:
    """``tmp_path``/pack: ``n`` files of 10 bytes under train/c (one class)."""
    (tmp_path / "src" / "train" / "c").mkdir(parents=True)
    for i in range(n):
        (tmp_path / "src" / "train" / "c" / f"{i}").write_bytes(bytes([i]) * 10)
    stagefs.pack(tmp_path / "src", tmp_path / "pack", progress=False)

def test_status_lists_stall_per_rank_and_epoch(tmp_path, monkeypatch, capsys) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"a" * 100)
    stagefs.pack(src, tmp_path / "pack", progress=False)
    rt = tmp_path / "rt"
    monkeypatch.setenv("STAGEFS_RUNTIME", str(rt))
    with stagefs.open(tmp_path / "pack", tiers=[f"{tmp_path}/tier:10MiB"]) as fs:
        assert fs.read("a") == b"a" * 100
    for pid, rank, stall in ((111, 1, 0.25), (222, 0, 0.5)):
        (rt / f"stall-{pid}.json").write_text(json.dumps({
            "pid": pid, "rank": rank, "updated": 0.0,
            "epochs": [{"epoch": 0, "steps": 10, "wait_s": 1.0, "step_s": 3.0,
                        "first_wait_s": 0.5, "stall": stall, "steady_stall": stall / 2}]}))
    (rt / "stall-333.json.partial").write_text("{half")  # being written: ignored

    assert main(["status", "--runtime", str(rt), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(r["rank"], r["pid"], r["stall"]) for r in doc["stalls"]] == [
        (0, 222, 0.5), (1, 111, 0.25)]

    assert main(["status", "--runtime", str(rt)]) == 0
    out = capsys.readouterr().out
    assert "data stall" in out and "50.0%" in out and "25.0%" in out


def test_status_without_stall_records(tmp_path, monkeypatch, capsys) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"a")
    stagefs.pack(src, tmp_path / "pack", progress=False)
    rt = tmp_path / "rt"
    with stagefs.open(tmp_path / "pack", tiers=[f"{tmp_path}/tier:10MiB"], runtime=str(rt)):
        pass
    assert main(["status", "--runtime", str(rt)]) == 0
    assert "data stall" not in capsys.readouterr().out


def test_a_meter_records_the_rank_the_launcher_gave(tmp_path, monkeypatch, capsys) -> None:
    """Under torchrun (or Slurm, MPI) a StallMeter made without ``rank=`` records the
    process's rank, so that `stagefs status` tells the ranks apart."""
    import pytest

    pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")
    from stagefs.torch import StallMeter

    for var in ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    ticks = iter(range(100))
    meter = StallMeter([1, 2, 3], runtime=str(tmp_path), clock=lambda: float(next(ticks)))
    assert list(meter) == [1, 2, 3]
    assert main(["status", "--runtime", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(r["rank"], r["steps"]) for r in doc["stalls"]] == [(2, 3)]


def test_status_shows_which_mode_each_epoch_ran(tmp_path, monkeypatch, capsys) -> None:
    """An auditor of a run under MLPerf Storage CLOSED rules could not tell from `stagefs
    status` (nor from the stall records) whether the Sampler ran closed or open."""
    import pytest

    pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")
    import torch.utils.data

    from stagefs.torch import FileDataset, Sampler, StallMeter

    _tiny_pack(tmp_path, 4)
    monkeypatch.delenv("STAGEFS_CLOSED", raising=False)
    ticks = iter(range(1000))
    with stagefs.open(tmp_path / "pack") as fs:
        ds = FileDataset(fs, target=None)
        for closed in (True, False):
            meter = StallMeter(torch.utils.data.DataLoader(
                ds, batch_size=2, sampler=Sampler(ds, closed=closed), collate_fn=list),
                write=False, rank=int(closed), clock=lambda: float(next(ticks)))
            assert sum(len(b) for b in meter) == 4
            assert meter.last is not None and meter.last.mode == ("closed" if closed else "open")
            meter.write(str(tmp_path / "rt" / f"stall-{int(closed)}.json"))  # one per process
        other = StallMeter([1], write=False, rank=2)
        assert list(other) == [1] and other.last is not None and other.last.mode is None
        other.write(str(tmp_path / "rt" / "stall-2.json"))
    assert main(["status", "--runtime", str(tmp_path / "rt"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(r["rank"], r["mode"]) for r in doc["stalls"]] == [
        (0, "open"), (1, "closed"), (2, None)]
    assert main(["status", "--runtime", str(tmp_path / "rt")]) == 0
    out = capsys.readouterr().out
    assert "| mode" in out and "| closed" in out and "| open" in out


def test_a_process_told_no_rank_shows_a_dash_not_none(tmp_path, monkeypatch, capsys) -> None:
    """A single training process (no launcher, no torch.distributed) records no rank; the
    table said "None" in its rank column."""
    import pytest

    pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")
    from stagefs.torch import StallMeter

    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE"):
        monkeypatch.delenv(var, raising=False)
    meter = StallMeter([1, 2], write=False)
    assert list(meter) == [1, 2]
    meter.write(str(tmp_path / "rt" / "stall-1.json"))
    assert main(["status", "--runtime", str(tmp_path / "rt"), "--json"]) == 0
    assert [r["rank"] for r in json.loads(capsys.readouterr().out)["stalls"]] == [None]
    assert main(["status", "--runtime", str(tmp_path / "rt")]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| -"))
    assert "None" not in out and row.split("|")[1].strip() == "-"


def test_a_sampler_in_a_batch_sampler_gives_its_epoch_and_mode(tmp_path, monkeypatch) -> None:
    """A DataLoader given ``batch_sampler=BatchSampler(Sampler(...))`` has torch's default
    as its own ``sampler``: the meter numbered the passes from 0 and recorded no mode, so a
    closed-mode run's epochs said nothing of the mode it ran in."""
    import pytest

    pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")
    import torch.utils.data as tud

    from stagefs.torch import FileDataset, Sampler, StallMeter

    _tiny_pack(tmp_path, 5)
    monkeypatch.delenv("STAGEFS_CLOSED", raising=False)
    ticks = iter(range(1000))
    with stagefs.open(tmp_path / "pack") as fs:
        ds = FileDataset(fs, target=None)
        for closed in (True, False):
            sampler = Sampler(ds, closed=closed)
            meter = StallMeter(tud.DataLoader(
                ds, batch_sampler=tud.BatchSampler(sampler, 2, False), collate_fn=list),
                write=False, clock=lambda: float(next(ticks)))
            for epoch in (3, 4):
                sampler.set_epoch(epoch)
                assert sum(len(b) for b in meter) == 5
            assert [(e.epoch, e.mode) for e in meter.epochs] == [
                (e, "closed" if closed else "open") for e in (3, 4)]
        # torch's own DistributedSampler inside a BatchSampler: its epoch, no mode
        dist = tud.DistributedSampler(ds, num_replicas=1, rank=0)
        dist.set_epoch(7)
        meter = StallMeter(tud.DataLoader(ds, batch_sampler=tud.BatchSampler(dist, 2, False),
                                          collate_fn=list), write=False)
        assert sum(len(b) for b in meter) == 5
        assert meter.last is not None and (meter.last.epoch, meter.last.mode) == (7, None)
