"""``stagefs demo`` as a user runs it: the console script, in a subprocess, on a small dataset."""

from __future__ import annotations

import errno
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import stagefs
from conftest import build_sample_tree
from stagefs.bench import demo
from stagefs.bench.demo import EpochResult, bar_chart
from stagefs.errors import ConfigError

pytestmark = pytest.mark.integration

EXE = shutil.which("stagefs")


def run(*args: str | Path, ok: bool = True, cwd: Path | None = None,
        home: Path | None = None) -> subprocess.CompletedProcess[str]:
    if EXE is None:
        pytest.skip("the stagefs console script is not on PATH (pip install -e .)")
    env = {**os.environ, "COLUMNS": "120"} | ({"HOME": str(home)} if home else {})
    proc = subprocess.run([EXE, "demo", *map(str, args)], capture_output=True, text=True,
                          timeout=300, check=False, env=env, cwd=cwd)
    assert "Traceback" not in proc.stderr
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc


def rows(out: str) -> list[tuple[int, str]]:
    """(epoch, system) of each row of the result table."""
    found = []
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].isdigit():
            found.append((int(cells[0]), cells[1]))
    return found


def test_demo_on_a_given_origin(tmp_path: Path) -> None:
    origin, out = tmp_path / "origin", tmp_path / "out"
    proc = run("--origin", origin, "--size", "8MiB", "--out", out)
    text = proc.stdout
    assert rows(text) == [(e, s) for e in (1, 2, 3) for s in ("plain files", "stagefs")]
    assert f"origin: {origin} (given with --origin)" in text
    assert "C accelerator: active" in text or "C accelerator: not used" in text
    assert "samples/s, per epoch" in text and "█" in text  # the terminal chart
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "demo.png").stat().st_size > 0
        assert f"chart: {out / 'demo.png'}" in text
    else:
        assert "pip install 'stagefs[plot]'" in text
    assert f"dataset kept in {origin}" in text  # generated where asked, so kept
    jpegs = list(origin.rglob("*.JPEG"))
    assert 8 * 2**20 * 0.8 < sum(p.stat().st_size for p in jpegs) < 8 * 2**20 * 1.25

    again = run("--origin", origin, "--out", out).stdout  # the files there are used
    assert f"using the {len(jpegs):,} files" in again and "generated" not in again
    assert len(rows(again)) == 6


def test_origin_errors_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such"
    proc = run("--origin", missing, ok=False)
    assert proc.returncode == 1 and str(tmp_path / "no") in proc.stderr
    assert "parent of --origin" in proc.stderr

    afile = tmp_path / "f"
    afile.write_bytes(b"x")
    proc = run("--origin", afile, ok=False)
    assert proc.returncode == 1 and str(afile) in proc.stderr and "not a file" in proc.stderr

    src, pack = tmp_path / "src", tmp_path / "pack"
    build_sample_tree(src)
    stagefs.pack(src, pack)
    proc = run("--origin", pack, ok=False)
    assert proc.returncode == 1 and f"{pack} is a pack" in proc.stderr
    assert "stagefs unpack" in proc.stderr


def test_bad_out_and_size_are_refused_before_the_run(tmp_path: Path) -> None:
    """An --out that cannot be written is said at once (it was found after the whole
    run), and --size 0 is refused (it generated one file)."""
    afile = tmp_path / "f"
    afile.write_bytes(b"x")
    origin = tmp_path / "origin"
    proc = run("--origin", origin, "--out", afile / "x", ok=False)
    assert proc.returncode == 1 and f"--out {afile / 'x'}" in proc.stderr
    assert "--out DIR" in proc.stderr and not origin.exists()  # nothing generated
    proc = run("--origin", origin, "--size", "0", ok=False)
    assert proc.returncode == 1 and "--size 0" in proc.stderr and not origin.exists()
    out = tmp_path / "out"  # a bad --origin leaves no empty --out made for the chart
    proc = run("--origin", afile, "--out", out, ok=False)
    assert proc.returncode == 1 and "--origin" in proc.stderr and not out.exists()


def test_a_tilde_after_the_equals_sign_is_the_home_directory(tmp_path: Path) -> None:
    """The shell expands '~' only at the start of a word: '--out=~/charts' made a
    directory named '~' in the working directory."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    text = run("--origin=~/origin", "--size", "2MiB", "--out=~/charts", cwd=cwd,
               home=home).stdout
    assert f"origin: {home / 'origin'} (given with --origin)" in text
    assert f"dataset kept in {home / 'origin'}" in text
    assert list(cwd.iterdir()) == []  # no '~' made here
    if importlib.util.find_spec("matplotlib") is not None:
        assert (home / "charts" / "demo.png").stat().st_size > 0


def test_a_full_origin_says_where_and_what_to_do(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system that fills up while the dataset is generated was a bare
    '[Errno 28] No space left on device' (and 'its generation was interrupted')."""
    def fill(root: str, **_: object) -> None:
        (Path(root) / "part").write_bytes(b"x")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(demo, "imagenet_like", fill)
    root = tmp_path / "origin"
    with pytest.raises(ConfigError) as info:
        demo.ensure_dataset(str(root), 300 * 2**20)
    said = str(info.value)
    assert str(root) in said and "No space left on device" in said and "300.0 MiB" in said
    assert "--size" in said and "--origin" in said


def test_bar_chart_scales_to_the_fastest() -> None:
    plain = [EpochResult("plain files", e, 1.0, 100, 0, 0, 0) for e in (1, 2)]
    fast = [EpochResult("stagefs", 1, 1.0, 100, 0, 0, 0), EpochResult("stagefs", 2, 0.1, 100,
                                                                      0, 0, 0)]
    bars = [line.count("█") for line in bar_chart(plain, fast, width=40).splitlines()[1:]]
    assert bars == [4, 4, 4, 40]


def test_a_demo_that_fails_leaves_no_empty_out(tmp_path: Path) -> None:
    """An error after the chart's directory was made (here: --origin a pack) left it
    behind, empty."""
    src, pack, out = tmp_path / "src", tmp_path / "pack", tmp_path / "out"
    build_sample_tree(src)
    stagefs.pack(src, pack)
    proc = run("--origin", pack, "--out", out, ok=False)
    assert proc.returncode == 1 and "is a pack" in proc.stderr
    assert not out.exists()


def test_a_tier_too_small_for_the_dataset_is_said(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A /dev/shm too small for the dataset (a container's 64 MiB): stagefs read every
    epoch from the origin, slower than plain files, under a text saying it reads a file
    from the origin once and "then never again"."""
    real = stagefs.open

    def small(root: str, tiers: list[str], runtime: str) -> stagefs.Store:
        return real(root, tiers=[f"{t}:64KiB" for t in tiers], runtime=runtime)

    monkeypatch.setattr(stagefs, "open", small)
    assert demo.run_demo(origin=str(tmp_path / "o"), size=2 * 2**20,
                         out=str(tmp_path / "out")) == 0
    text = capsys.readouterr().out
    assert "Here the RAM tier could not hold the dataset" in text
    assert "from the origin in epoch 3 too" in text
