"""Help a person can use: the overview, each command's examples, defaults, sizes and
environment variables; python -m stagefs; bash completion; docs/cli.md current."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stagefs import cli
from stagefs._help import COMMANDS, _default, _wrap, commands, markdown
from stagefs.config import ENV_VARS, env

ROOT = Path(__file__).resolve().parents[2]
SRC = str(ROOT / "src")


def _python(*args: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k not in ("STAGEFS_RUNTIME",
                                                                 "STAGEFS_JOB")}
    environ["PYTHONPATH"] = os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          env=environ, timeout=120)


def test_bare_stagefs_prints_the_overview_and_exits_0(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: stagefs")
    for name in commands(cli.build_parser()):
        assert re.search(rf"^    {name}\b", out, re.M), name
    assert "Start here:" in out and "2GiB" in out and "STAGEFS_TIERS" in out


def test_python_m_stagefs_runs_the_command() -> None:
    p = _python("-m", "stagefs", "--help")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: stagefs") and "Start here:" in p.stdout
    p = _python("-m", "stagefs")
    assert p.returncode == 0 and "Start here:" in p.stdout


@pytest.mark.parametrize("name", sorted(commands(cli.build_parser())))
def test_every_command_help_has_examples_defaults_and_its_variables(
        name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main([name, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    examples, names, sizes = COMMANDS[name]
    assert "Examples:" in out and len(examples) >= 2
    assert all(f"  {_wrap(e)}" in out for e in examples)
    assert max(len(line) for line in out.split("Examples:")[1].splitlines()) <= 88
    assert all(n in out for n in names)
    assert ("Sizes:" in out) == sizes
    if not names:
        assert "reads no STAGEFS_* variable" in out
    flat = " ".join(out.split())
    for a in commands(cli.build_parser())[name]._actions:  # each default worth showing
        if (d := _default(a)) is not None:
            assert f"(default: {d})" in flat, a


def test_every_command_has_its_help_entry() -> None:
    """A command added to the parser without examples fails here: add it to COMMANDS."""
    assert set(commands(cli.build_parser())) - set(COMMANDS) == set()


def test_defaults_are_shown(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "copies of each shard (default: 1)" in out
    assert "(default: None)" not in out and "(default: False)" not in out


def test_every_stagefs_variable_in_the_source_is_listed() -> None:
    """ENV_VARS is the one list: any STAGEFS_* the code names is in it, and env() refuses
    a name that is not."""
    found: set[str] = set()
    for path in (ROOT / "src" / "stagefs").rglob("*.py"):
        found |= set(re.findall(r"STAGEFS_[A-Z][A-Z_]*[A-Z]", path.read_text()))
        found |= {"STAGEFS_" + n.upper()
                  for n in re.findall(r"\benv\(\"([A-Za-z_]+)\"", path.read_text())}
    assert found - set(ENV_VARS) == set()
    with pytest.raises(KeyError, match="ENV_VARS"):
        env("no_such_variable")


def test_job_option_names_the_runtime() -> None:
    p = _python("-m", "stagefs", "clean", "--job", "help-test-job")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().endswith(f"stagefs-{os.getuid()}/help-test-job)"), p.stdout
    for name, sp in commands(cli.build_parser()).items():  # wherever --runtime is
        has_runtime = any("--runtime" in a.option_strings for a in sp._actions)
        assert has_runtime == any("--job" in a.option_strings for a in sp._actions), name


def test_docs_cli_md_is_current() -> None:
    """docs/cli.md is generated: python -m stagefs._help > docs/cli.md"""
    assert (ROOT / "docs" / "cli.md").read_text() == markdown(cli.build_parser()), (
        "docs/cli.md is stale: run 'python -m stagefs._help > docs/cli.md'")


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
@pytest.mark.parametrize(("words", "expect"), [
    (["pa"], {"pack"}),
    (["pack", "--sh"], {"--shard-size"}),
    (["pack", "--compress", ""], {"auto", "zstd", "none"}),
    (["-v", "st"], {"stat", "stage", "status"}),
    (["completion", ""], {"bash"}),
    (["clean", "--j"], {"--job"}),
])
def test_bash_completion(words: list[str], expect: set[str]) -> None:
    script = _python("-m", "stagefs", "completion", "bash")
    assert script.returncode == 0, script.stderr
    words_s = " ".join(f"'{w}'" for w in ["stagefs", *words])
    probe = (f"{script.stdout}\nCOMP_WORDS=({words_s}); COMP_CWORD={len(words)}; _stagefs; "
             'printf "%s\\n" "${COMPREPLY[@]}"')
    out = subprocess.run(["bash", "--norc", "-c", probe], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert set(out.split()) == expect
