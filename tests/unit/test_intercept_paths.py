"""Which paths an interception claims (pure path logic; no patching)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from stagefs.errors import ConfigError
from stagefs.posix.intercept import Interceptor


def _icpt(at: str) -> Interceptor:
    return Interceptor(SimpleNamespace(pack_dir="/packs/p"), at)


@pytest.mark.parametrize(("path", "expected"), [
    ("/data/in", ""),
    ("/data/in/", ""),
    ("/data/in/a.jpg", "a.jpg"),
    ("/data/in/x/y/z", "x/y/z"),
    ("/data/in//x/./y", "x/y"),
    ("/data/other/../in/x", "x"),
    ("/data/in/x/../../in/y", "y"),
    ("/data/inner/x", None),
    ("/data/i", None),
    ("/data", None),
    ("/data/in/..", None),
    ("/elsewhere/a", None),
    (b"/data/in/b\xffy", "b\udcffy"),
    (Path("/data/in/p"), "p"),
    (3, None),
    (None, None),
])
def test_rel_claims_exactly_the_paths_under_at(path: object, expected: str | None) -> None:
    assert _icpt("/data/in/").rel(path) == expected


def test_relative_paths_resolve_against_the_current_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    icpt = _icpt(str(tmp_path / "d"))
    assert icpt.rel("d/x") == "x"
    assert icpt.rel("./d") == ""
    assert icpt.rel("e/x") is None
    assert _icpt("d").root == os.path.join(str(tmp_path), "d")


def test_refused_roots() -> None:
    with pytest.raises(ConfigError, match="cannot intercept '/'"):
        _icpt("/")
    with pytest.raises(ConfigError, match="lies under the intercepted path"):
        _icpt("/packs")
    with pytest.raises(ConfigError, match="lies under the intercepted path"):
        _icpt("/packs/p")
    assert _icpt("/packs/q").root == "/packs/q"


def test_run_refuses_an_at_over_the_dataset_before_opening_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``stagefs run --at DIR DIR`` on a raw tree scanned it all (minutes for a large one)
    before it said the path could not be intercepted."""
    import stagefs
    from stagefs.cli import main

    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "a").write_bytes(b"x")
    opened: list[object] = []
    monkeypatch.setattr(stagefs, "open", lambda *a, **k: opened.append(a))
    assert main(["run", "--dataset", str(tree), "--at", str(tree), "--", "true"]) != 0
    assert "lies under the intercepted path" in capsys.readouterr().err
    assert opened == []

