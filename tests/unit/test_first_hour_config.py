"""A new user's first hour: values they mistype get an error that names them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stagefs.config import parse_tier
from stagefs.errors import ConfigError


@pytest.mark.parametrize("spec", [":1G", " :50%", ":"])
def test_a_tier_with_no_directory_is_an_error_not_the_current_directory(
        spec: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"names no directory|no capacity after"):
        parse_tier(spec)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("spec, size", [(" {d} :1MiB", 2**20), ("{d}: 1MiB ", 2**20),
                                        ("  {d}  ", None), ("\t{d}:50%", "share")])
def test_spaces_around_a_tiers_directory_and_size_are_not_part_of_them(
        spec: str, size: int | str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """``STAGEFS_TIERS=" /dev/shm/x :1GiB"`` (or a list written with ", ") made a directory
    named with a space at its end, or one under the current directory."""
    monkeypatch.chdir(tmp_path)
    d = tmp_path / "t"
    got = parse_tier(spec.format(d=d))
    assert got.path == str(d)
    assert got.share == 50.0 if size == "share" else got.capacity == size
    assert os.listdir(tmp_path) == []


def test_a_bad_tier_size_names_the_tier() -> None:
    with pytest.raises(ConfigError, match=r"tier '/dev/shm/b:10X': not a size"):
        parse_tier("/dev/shm/b:10X")


@pytest.mark.parametrize("spec", ["/dev/shm/b:1.5", "/dev/shm/b:0.5b"])
def test_a_tier_size_of_a_fraction_of_a_byte_is_an_error(spec: str) -> None:
    """``DIR:1.5`` (a unit forgotten) was a tier of 1 byte, silently: it held nothing."""
    with pytest.raises(ConfigError, match=r"not a size: .* fraction of a byte; give whole "
                       r"bytes or a unit \(\d\.5GiB"):
        parse_tier(spec)
    assert parse_tier("/dev/shm/b:1.5GiB").capacity == 3 * 2**29


@pytest.mark.parametrize("argv, named", [
    (["pack", "SRC", "DEST", "--shard-size", "-1"], "--shard-size: "),
    (["pack", "SRC", "DEST", "--align", "10X"], "--align: "),
    (["demo", "--size", "1e3G"], "--size: "),
])
def test_a_bad_size_option_is_named(argv: list[str], named: str, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    from stagefs import cli

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"x")
    argv = [str(tmp_path / a.lower()) if a in ("SRC", "DEST") else a for a in argv]
    with pytest.raises(SystemExit) as exc:  # a usage error, as a bad number is: status 2
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {named}" in err and "not a size" in err, err
    assert "usage: stagefs " + argv[0] in err, err  # the command's usage
    assert not (tmp_path / "dest").exists()


def test_a_blank_runtime_is_an_error_not_a_directory_named_blank(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stagefs.cluster.world import runtime_default
    from stagefs.runtime import Runtime

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("STAGEFS_RUNTIME", "  ")
    with pytest.raises(ConfigError, match="blank"):
        Runtime().open()
    with pytest.raises(ConfigError, match="blank"):
        runtime_default()
    assert os.listdir(tmp_path) == []


def test_a_runtime_directory_is_not_opened_as_a_dataset(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a likely slip: FileDataset(runtime) or stagefs.open(runtime) made its token file and
    # cluster map "dataset files"
    import stagefs
    from stagefs.runtime import Runtime

    rt = Runtime(tmp_path / "rt").open()
    with pytest.raises(ConfigError, match="runtime directory"):
        stagefs.open(rt.path)
    (tmp_path / "rt" / "cluster.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"stagefs\.connect\(runtime="):
        stagefs.open(rt.path)


def test_a_relative_path_in_a_removed_current_directory_names_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A shell left in a directory that was removed (``cd d; rmdir ../d``, a job's scratch
    directory cleaned under it): a relative dataset, tier, runtime or pack source was a
    bare ``FileNotFoundError: [Errno 2] No such file or directory`` naming nothing (the
    current directory's getcwd), and the CLI said only that. Each names the path, the
    removed current directory, and what to do."""
    import stagefs
    from stagefs.cli import main
    from stagefs.runtime import Runtime

    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    calls = {
        "data.pack": lambda: stagefs.open("data.pack"),
        "t0:1MiB": lambda: parse_tier("t0:1MiB"),
        "rt": lambda: Runtime("rt"),
        "src": lambda: stagefs.pack("src", str(tmp_path / "out.pack"), progress=False),
    }
    for name, call in calls.items():
        with pytest.raises(FileNotFoundError, match="current directory no longer exists") \
                as got:
            call()
        assert got.value.filename == name.partition(":")[0] and "cd to" in str(got.value)
    assert main(["ls", "data.pack"]) == 1
    err = capsys.readouterr().err
    assert "current directory no longer exists" in err and "'data.pack'" in err, err


@pytest.mark.parametrize("value, says", [("abc", "must be a number, not 'abc'"),
                                         ("nan", "must be a number, not 'nan'"),
                                         ("-1", "must be at least 0, not '-1'")])
def test_a_connect_timeout_that_is_not_seconds_is_named(
        value: str, says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """STAGEFS_CONNECT_TIMEOUT=abc was float()'s ValueError from inside connect(), which
    named no variable; =nan made connect() wait for ever for a cluster that was not there."""
    import stagefs

    monkeypatch.setenv("STAGEFS_RUNTIME", str(tmp_path / "rt"))
    monkeypatch.setenv("STAGEFS_CONNECT_TIMEOUT", value)
    with pytest.raises(ConfigError, match=f"STAGEFS_CONNECT_TIMEOUT {says}"):
        stagefs.connect()


@pytest.mark.parametrize("timeout", [float("nan"), -1, "5", True])
def test_a_connect_timeout_argument_that_is_not_seconds_is_named(
        timeout: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """connect(timeout=nan) waited for ever (no clock is past nan), a string failed deep
    inside: the argument is named with what it takes."""
    import stagefs

    monkeypatch.setenv("STAGEFS_RUNTIME", str(tmp_path / "rt"))
    with pytest.raises(ValueError, match=r"connect\(timeout=\.\.\.\) is the seconds .* not "):
        stagefs.connect(timeout=timeout)  # type: ignore[arg-type]


@pytest.mark.parametrize("name, value, says", [
    ("PEER_TIMEOUT", "10s", "must be a number, not '10s'"),
    ("PEER_TIMEOUT", "0", "must be more than 0, not '0'"),
    ("READ_THREADS", "2.5", "must be a whole number, not '2.5'"),
])
def test_a_number_variable_names_itself_and_what_it_takes(
        name: str, value: str, says: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from stagefs.config import env_number

    monkeypatch.setenv(f"STAGEFS_{name}", value)
    whole = name == "READ_THREADS"
    with pytest.raises(ConfigError, match=f"STAGEFS_{name} {says}"):
        env_number(name, 1, whole=whole, above=not whole)
    monkeypatch.setenv(f"STAGEFS_{name}", " 3 ")
    assert env_number(name, 1, whole=whole) == 3
    monkeypatch.delenv(f"STAGEFS_{name}")
    assert env_number(name, 1, whole=whole) == 1
