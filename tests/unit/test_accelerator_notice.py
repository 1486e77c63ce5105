"""Whether the C accelerator runs is said: by `stagefs info`, and once per process by a
notice when it is not built."""

from __future__ import annotations

import logging
import re
import sys

import pytest

import stagefs
from stagefs import namespace
from stagefs.cli import main


@pytest.fixture
def pack_dir(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_bytes(b"a")
    stagefs.pack(tmp_path / "src", tmp_path / "pack", progress=False)
    return tmp_path / "pack"


@pytest.fixture
def not_built(monkeypatch):
    """As on a machine where the extension was not compiled: importing it fails."""
    monkeypatch.setitem(sys.modules, "stagefs._speedups", None)
    monkeypatch.setattr(namespace, "_noticed", False)
    monkeypatch.delenv("STAGEFS_SPEEDUPS", raising=False)


def notices(caplog):
    return [r for r in caplog.records
            if r.name == "stagefs" and "C accelerator is not built" in r.getMessage()]


def test_not_built_logs_one_notice_per_process(pack_dir, not_built, caplog):
    caplog.set_level(logging.WARNING, logger="stagefs")
    for _ in range(3):
        with stagefs.open(pack_dir) as fs:
            assert not fs.namespace.accelerated
            assert fs.read("a.txt") == b"a"
    (notice,) = notices(caplog)
    assert notice.levelno == logging.WARNING
    text = notice.getMessage()
    assert "6x slower" in text and "C compiler" in text and "pip install --force-reinstall" in text


def test_switched_off_gives_no_notice(pack_dir, not_built, monkeypatch, caplog):
    monkeypatch.setenv("STAGEFS_SPEEDUPS", "0")
    caplog.set_level(logging.WARNING, logger="stagefs")
    with stagefs.open(pack_dir) as fs:
        assert not fs.namespace.accelerated
    assert notices(caplog) == []
    assert namespace.accelerator() == "off (STAGEFS_SPEEDUPS=0)"


def test_info_says_not_built_and_how_to_build(pack_dir, not_built, capsys):
    assert main(["info", str(pack_dir)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.startswith("C accelerator"))
    assert "not built" in row and "6x slower" in row and "C compiler" in row


def test_info_says_active_when_built(pack_dir, monkeypatch, caplog, capsys):
    pytest.importorskip("stagefs._speedups", reason="the C accelerator is not built")
    monkeypatch.delenv("STAGEFS_SPEEDUPS", raising=False)
    monkeypatch.setattr(namespace, "_noticed", False)
    caplog.set_level(logging.WARNING, logger="stagefs")
    assert main(["info", str(pack_dir)]) == 0
    assert re.search(r"^C accelerator +active$", capsys.readouterr().out, re.M)
    assert notices(caplog) == []
