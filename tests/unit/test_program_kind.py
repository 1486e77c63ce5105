"""Which programs ``stagefs run`` can serve: Python, launchers of Python, or neither."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from stagefs.posix.intercept import program_kind


def _script(path: Path, shebang: str) -> str:
    path.write_text(f"#!{shebang}\n")
    path.chmod(0o755)
    return str(path)


def test_python_interpreters_and_python_scripts(tmp_path: Path) -> None:
    assert program_kind([sys.executable, "train.py"]) == "python"
    assert program_kind([_script(tmp_path / "torchrun", "/usr/bin/env python3")]) == "python"
    assert program_kind([_script(tmp_path / "tool", sys.executable)]) == "python"


def test_shells_launchers_and_programs_that_start_python(tmp_path: Path) -> None:
    if shutil.which("sh") is None or shutil.which("ls") is None:
        pytest.skip("no sh or ls on PATH")
    assert program_kind(["sh", "-c", "ls"]) == "launcher"  # a shell may start Python
    assert program_kind([_script(tmp_path / "job.sh", "/bin/sh")]) == "launcher"
    assert program_kind(["ls", "train.py"]) == "launcher"  # names a Python file
    assert program_kind(["ls", "/data"]) == "native"
    assert program_kind([str(tmp_path / "nope")]) == "missing"
    assert program_kind([os.path.realpath(shutil.which("ls") or "")]) == "native"
