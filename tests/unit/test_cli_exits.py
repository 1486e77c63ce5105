"""The ``stagefs`` command as scripts and batch jobs see it: a command line that cannot work
is the command's usage and status 2; SIGTERM (scancel, the time limit) cleans up as Ctrl-C
does and is status 143."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import stagefs
from conftest import pack_files
from stagefs import cli
from stagefs._help import commands

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv", [
    ["pack", "--shard-sise", "1MiB", "src", "dest"],  # a typo in a command's option
    ["clean", "--bogus"],
    ["pack", "--shard-size", "lots", "src", "dest"],  # a bad size, as a bad number (-j x)
    ["demo", "--size", "1Q"],
    ["-v", "--bogus", "doctor"],
    ["serve"],  # no ORIGIN (and no --new-token)
    ["run", "--at", "/data"],  # no command
    ["run", "--at", "/data", "--any-program", "--", "true"],  # no dataset, no --connect
    ["run", "--dataset", "d", "--connect", "--at", "/data", "--any-program", "--", "true"],
    # the cluster's tiers are its daemon's: a --tier here was dropped without a word
    ["run", "--connect", "--tier", "/tmp/t:1GiB", "--at", "/data", "--any-program", "--",
     "true"],
])
def test_a_command_line_that_cannot_work_is_the_commands_usage_and_2(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    name = next(a for a in argv if not a.startswith("-"))
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: stagefs {name} "), err
    assert f"\nstagefs {name}: error: " in err and "Traceback" not in err


def test_sigterm_cleans_up_as_an_interrupt_and_exits_143(tmp_path: Path) -> None:
    """The demo's temporary dataset and its RAM tier are removed when the job's time runs
    out (Slurm's SIGTERM), not left on the shared file system and in /dev/shm."""
    made = tmp_path / "made.txt"
    script = textwrap.dedent(f"""
        import os, signal, sys, tempfile
        from stagefs import cli
        from stagefs.bench import demo

        origin = {str(tmp_path / "origin")!r}
        real_mkdtemp = tempfile.mkdtemp

        def mkdtemp(*args, **kwargs):
            path = real_mkdtemp(*args, **kwargs)
            with open({str(made)!r}, "a") as f:
                f.write(path + "\\n")
            return path

        def killed(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)
            raise AssertionError("SIGTERM did not stop the command")

        demo.tempfile.mkdtemp = mkdtemp
        demo.choose_origin = lambda given: (origin, "a temp dir", True)
        demo.plain_epochs = killed
        sys.exit(cli.main(["demo", "--size", "256KiB", "--out", {str(tmp_path / "out")!r}]))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, proc.stderr)
    assert proc.stderr.strip().splitlines()[-1] == "stagefs: terminated", proc.stderr
    assert "Traceback" not in proc.stderr
    scratch = made.read_text().split()
    assert scratch and not any(os.path.exists(p) for p in scratch)  # the RAM tier
    assert not (tmp_path / "origin").exists()  # the generated dataset


def test_sigterm_handler_is_the_commands_only(capsys: pytest.CaptureFixture[str]) -> None:
    """A program calling main() keeps its own SIGTERM disposition afterwards."""
    before = signal.getsignal(signal.SIGTERM)
    assert cli.main(["completion", "bash"]) == 0
    assert signal.getsignal(signal.SIGTERM) == before
    capsys.readouterr()


def test_verbose_is_taken_before_and_after_every_command() -> None:
    """-v where a batch script adds it, at the end (stagefs serve ... -v), as well as first."""
    parser = cli.build_parser()
    for name, sp in commands(parser).items():
        assert any("-v" in a.option_strings for a in sp._actions), name
    argv = ["info", "/data/x.pack"]
    assert parser.parse_args(argv).verbose is False
    assert parser.parse_args(["-v", *argv]).verbose is True
    assert parser.parse_args([*argv, "-v"]).verbose is True
    assert parser.parse_args(["mount", "/data/x.pack", "-v", "/mnt/x"]).verbose is True


def test_exit_statuses_are_documented(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    doc = (ROOT / "docs" / "cli.md").read_text()
    for code in (0, 1, 2, 126, 127, 130, 141, 143):
        assert f"{code} " in out.split("Exit status:")[1], code
        assert f"{code} " in doc.split("## Exit status")[1], code


def _keys(doc: object) -> set[str]:
    if isinstance(doc, dict):
        return set(doc) | {k for v in doc.values() for k in _keys(v)}
    if isinstance(doc, list):
        return {k for v in doc for k in _keys(v)}
    return set()


def test_every_key_of_status_json_is_documented(tmp_path: Path, runtime: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    pack = pack_files(tmp_path, "ds", {f"d/{i}": os.urandom(100 + i) for i in range(20)})
    with stagefs.open(pack, tiers=[str(tmp_path / "tier")]) as fs:
        fs.read_many([f"d/{i}" for i in range(20)])
    assert cli.main(["status", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)  # one document
    said = set(re.findall(r"`([a-z_]+)`", (ROOT / "docs" / "status.md").read_text()))
    keys = _keys({k: v for k, v in doc.items() if k != "stalls"})
    assert keys - said == set()


def test_sigterm_to_the_job_during_a_pool_ends_it_quietly(tmp_path: Path) -> None:
    """scancel signals every process of the step: pack's worker processes as well as pack.
    The pack ends 143 with one line, no worker's traceback nor the pool's."""
    src = tmp_path / "src"
    for i in range(40):
        (src / f"d{i % 4}").mkdir(parents=True, exist_ok=True)
        (src / f"d{i % 4}" / f"f{i}").write_bytes(os.urandom(20_000))
    script = textwrap.dedent(f"""
        import importlib, os, signal, sys
        from stagefs import cli

        pack = importlib.import_module("stagefs.pack")  # (stagefs.pack is also a function)
        real = pack._write_shard

        def write_shard(*args, **kwargs):  # in a worker, once both are up: the whole job
            parent = os.getppid()
            with open(f"/proc/{{parent}}/task/{{parent}}/children") as f:
                while len(f.read().split()) < 2:
                    f.seek(0)
            try:
                os.close(os.open({str(tmp_path / "signalled")!r}, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                os.kill(0, signal.SIGTERM)
            return real(*args, **kwargs)

        pack._write_shard = write_shard
        sys.exit(cli.main(["pack", {str(src)!r}, {str(tmp_path / "p")!r}, "-j", "2",
                           "--shard-size", "64KiB", "--compress", "none"]))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=120, check=False, start_new_session=True)
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, proc.stderr)
    assert proc.stderr.strip() == "stagefs: terminated", proc.stderr


def test_sigterm_in_a_forked_child_before_its_hook_is_left_to_the_parent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool worker forked from the command gets SIGTERM (scancel signals every process)
    while its at-fork hooks run, before the one that makes it ignore SIGTERM: the handler
    it inherited raised there, and the worker printed "Exception ignored in ...
    ensure_current_process" with a traceback (once in about ten runs of the test above). In
    a process other than the one that set it, the handler does nothing now; in that one it
    raises Terminated once."""
    from stagefs import cli

    monkeypatch.setattr(cli, "_TERMINATED", [False])
    monkeypatch.setattr(cli, "_HANDLER_PID", [os.getpid() + 1])  # as in a forked child
    cli._terminate(signal.SIGTERM, None)
    assert cli._TERMINATED == [False]
    monkeypatch.setattr(cli, "_HANDLER_PID", [os.getpid()])
    with pytest.raises(cli.Terminated):
        cli._terminate(signal.SIGTERM, None)
    assert cli._TERMINATED == [True]
    cli._terminate(signal.SIGTERM, None)  # a second: nothing


def test_bench_results_on_stdout_its_progress_on_stderr(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """stagefs bench > results.md holds the results, not the log of the run."""
    rc = cli.main(["bench", "--files", "4", "--epochs", "1", "--runs", "1",
                   "--no-drop-caches", "--origin", str(tmp_path / "o"),
                   "--out", str(tmp_path / "r"), "--local", str(tmp_path / "local"),
                   "--systems", "plain-local"])
    assert rc == 0
    out = capsys.readouterr()
    assert "run 1/1: plain-local" in out.err and "generating" in out.err
    assert not re.search(r"^\[\d\d:\d\d:\d\d\]", out.out, re.M), out.out
    assert "| plain-local" in out.out and f"written to {tmp_path / 'r'}" in out.out


@pytest.mark.parametrize("var", ["STAGEFS_CLOSED", "STAGEFS_FABRIC", "STAGEFS_TIER_MAP"])
def test_a_switch_that_is_not_one_is_refused_before_any_command_starts(
        var: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``STAGEFS_CLOSED=maybe``: ``stagefs bench`` ran its open systems and failed the one
    that read the switch; now every command refuses it first, with the forms it takes.
    ``stagefs doctor`` runs, and lists it among its errors."""
    pack = pack_files(tmp_path, "d", {"a.txt": b"a"})
    monkeypatch.setenv(var, "maybe")
    for argv in (["info", str(pack)], ["bench", "--files", "10", "--epochs", "1", "--runs",
                                        "1", "--out", str(tmp_path / "b")]):
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert f"{var}='maybe' is not a switch: use 1 or 0 (or true/false, yes/no, on/off)" \
            in err
    assert not (tmp_path / "b").exists()
    monkeypatch.setenv(var, " Yes ")
    assert cli.main(["info", str(pack)]) == 0
    from stagefs.doctor import check_switches
    monkeypatch.setenv(var, "2")
    assert [(f.check, f.status) for f in check_switches()] == [(var, "error")]
