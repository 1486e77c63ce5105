"""``stagefs mount``'s arguments in any order, as users type them: the options between
the dataset and the mount point (``stagefs mount PACK --tier T MNT`` was refused: argparse
gave both positionals to the first word and called the mount point unrecognized)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagefs import cli
from stagefs.cli import build_parser


@pytest.mark.parametrize("argv", [
    ["mount", "/d/pack", "/mnt/x", "--tier", "/dev/shm/t:1GiB", "-f"],
    ["mount", "/d/pack", "--tier", "/dev/shm/t:1GiB", "/mnt/x", "-f"],
    ["mount", "--tier", "/dev/shm/t:1GiB", "/d/pack", "-f", "/mnt/x"],
    ["mount", "-f", "/d/pack", "--tier", "/dev/shm/t:1GiB", "/mnt/x"],
])
def test_options_may_come_between_the_dataset_and_the_mount_point(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert (args.dataset, args.mountpoint) == ("/d/pack", "/mnt/x")
    assert args.tier == ["/dev/shm/t:1GiB"] and args.foreground


def test_the_mount_point_alone_with_connect() -> None:
    args = build_parser().parse_args(["mount", "--connect", "/mnt/x", "--runtime", "/r"])
    assert (args.dataset, args.mountpoint, args.connect) == (None, "/mnt/x", True)


def test_a_third_path_is_still_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["mount", "/d/pack", "--tier", "/t", "/mnt/x", "/extra"])
    assert exc.value.code == 2
    assert "/extra" in capsys.readouterr().err


def test_connect_with_a_tier_is_refused_not_dropped(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The cluster's reads go through its daemon's tiers: a --tier given with --connect was
    dropped without a word, and the mount read as if the user's tier were there."""
    from stagefs.posix.fuse import fuse_available

    if fuse_available():
        pytest.skip(fuse_available())
    (tmp_path / "mnt").mkdir()
    tier = tmp_path / "t"
    with pytest.raises(SystemExit) as exc:
        cli.main(["mount", "--connect", "--runtime", str(tmp_path / "rt"), "--tier",
                  f"{tier}:1MiB", str(tmp_path / "mnt")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "stagefs mount: error: --tier is not used with --connect" in err, err
    assert not tier.exists()
