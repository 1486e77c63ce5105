"""The suite tests the stagefs it means to: .ci/run installs the wheel in a venv and sets
STAGEFS_EXPECT_INSTALLED to that venv's site-packages, so a source tree on sys.path, or a
`stagefs` script from elsewhere on PATH, fails here instead of passing untested code.

Whatever is installed, the package carries the files it reads at run time.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

import stagefs
from stagefs.posix.intercept import BOOTSTRAP_DIR

PACKAGE = Path(stagefs.__file__).resolve().parent


def test_the_package_carries_its_data_files() -> None:
    assert (PACKAGE / "py.typed").is_file()
    # `stagefs run` puts this directory on the child's PYTHONPATH
    assert Path(BOOTSTRAP_DIR, "sitecustomize.py").is_file()


def test_stagefs_is_the_installed_package_when_ci_says_so() -> None:
    site = os.environ.get("STAGEFS_EXPECT_INSTALLED")
    if not site:
        pytest.skip("STAGEFS_EXPECT_INSTALLED is not set (.ci/run sets it to the venv's "
                    "site-packages)")
    assert PACKAGE.is_relative_to(Path(site).resolve()), (
        f"stagefs was imported from {PACKAGE}, not from the installed wheel in {site}")
    script = shutil.which("stagefs")
    assert script is not None, "no `stagefs` script on PATH"
    assert Path(script).parent == Path(sys.executable).parent, (
        f"`stagefs` on PATH is {script}, not the script of {sys.executable}'s venv")
