"""A node shared by several users and jobs, seen by an unprivileged user (``as_nobody``):
a dataset another user keeps private, a tier directory shared by users (``/dev/shm``
itself, a scratch directory), a runtime variable naming a directory of another use, and a
node without FUSE for this user. Each is a clear error that names the thing and says what
to do, or works; never a traceback from deep inside, a lie, or another user's data touched.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import stagefs
from conftest import as_nobody, build_sample_tree, world_dir
from stagefs.errors import ConfigError
from stagefs.runtime import Runtime, clean

NOBODY = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as two users")


@pytest.fixture()
def world() -> Iterator[Path]:
    with world_dir() as d:
        yield d


def _pack(world: Path, name: str = "pack") -> Path:
    """A pack every user may read."""
    src = build_sample_tree(world / f"{name}-src")
    dest = world / name
    stagefs.pack(src, dest, shard_size="64KiB", jobs=1, progress=False, echo=lambda _m: None)
    for f in os.listdir(dest):
        os.chmod(dest / f, 0o644)
    os.chmod(dest, 0o755)
    return dest


def _read_one(fs: stagefs.Store) -> None:
    top, _dirs, files = next(fs.walk(""))
    fs.read(os.path.join(top, files[0]))


def _own_runtime(world: Path) -> Path:
    """A directory the unprivileged user may make its runtime in."""
    d = world / "nobody"
    d.mkdir()
    os.chown(d, NOBODY, NOBODY)
    return d


def test_a_dataset_in_another_users_private_directory_is_permission_denied(world: Path
                                                                          ) -> None:
    private = world / "private"
    private.mkdir()
    pack = _pack(private)
    os.chmod(private, 0o700)  # its owner's (root's) alone

    def reader() -> None:
        stagefs.open(pack)

    code, msg = as_nobody(reader)
    # before: FileNotFoundError "No such file or directory (no dataset here)"
    assert code == 2 and "PermissionError" in msg and "No such file" not in msg, msg
    assert str(private) in msg and "root (uid 0)" in msg and "ask its owner" in msg, msg


def test_a_tier_shared_by_users_holding_another_users_copy_is_refused_by_name(
        world: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pack = _pack(world)
    tier = world / "scratch"  # a directory every user may write (a site's scratch, /dev/shm)
    tier.mkdir()
    os.chmod(tier, 0o1777)
    monkeypatch.setenv("STAGEFS_RUNTIME", str(world / "root-rt"))
    with stagefs.open(pack, tiers=[f"{tier}:64MiB"]) as fs:
        _read_one(fs)  # root's copy, private to root
    mine = _own_runtime(world)

    def reader() -> None:
        os.environ["STAGEFS_RUNTIME"] = str(mine / "rt")
        with stagefs.open(pack, tiers=[f"{tier}:64MiB"]) as fs:
            _read_one(fs)

    code, msg = as_nobody(reader)
    # before: PermissionError on <tier>/<pack id>/shard-000000.sfs.partial, from inside
    assert code == 1 and msg.startswith("ConfigError"), msg
    assert str(tier) in msg and "root (uid 0)" in msg and "of your own" in msg, msg


def test_a_tier_shared_by_users_places_this_users_own_dataset(
        world: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pack, other = _pack(world, "mine"), _pack(world, "theirs")
    tier = world / "scratch"
    tier.mkdir()
    os.chmod(tier, 0o1777)
    monkeypatch.setenv("STAGEFS_RUNTIME", str(world / "root-rt"))
    with stagefs.open(other, tiers=[f"{tier}:64MiB"]) as fs:  # root's private copy there
        fs.chain.stage(list(range(len(fs.manifest.shards))))
    mine = _own_runtime(world)

    def stage() -> None:
        os.environ["STAGEFS_RUNTIME"] = str(mine / "rt")
        with stagefs.open(pack, tiers=[f"{tier}:64MiB"]) as fs:
            n = len(fs.manifest.shards)
            fs.chain.stage(list(range(n)))
            held, stopped = fs.held_shards(), [t.stopped for t in fs.chain.tiers]
            if len(held) != n or any(stopped):
                raise AssertionError(f"held {sorted(held)} of {n}; stopped: {stopped}")

    code, msg = as_nobody(stage)
    # before: "placement stopped ([Errno 13] Permission denied: '<tier>/<root's copy>')"
    assert code == 0, msg


def test_clean_never_touches_or_claims_another_users_tier_copy(world: Path) -> None:
    tier = world / "scratch"
    tier.mkdir()
    os.chmod(tier, 0o1777)
    theirs = tier / "0123abcd"  # another user's copy, under the name a record points to
    theirs.mkdir()
    os.chmod(theirs, 0o777)
    (theirs / "shard-000000.sfs").write_bytes(b"another user's data")
    os.chmod(theirs / "shard-000000.sfs", 0o666)
    mine = _own_runtime(world)

    def clean_it() -> None:
        rt = Runtime(str(mine / "rt")).open()
        rt.record_tiers("0123abcd", [str(tier)])
        rt.unregister()
        removed = clean([rt])
        if str(theirs) in removed:
            raise AssertionError(f"clean says it removed {theirs}: {removed}")

    code, msg = as_nobody(clean_it)
    assert code == 0, msg
    assert (theirs / "shard-000000.sfs").read_bytes() == b"another user's data"


@pytest.mark.parametrize("owner", ["self", "root"])
def test_clean_refuses_a_runtime_variable_naming_a_directory_of_another_use(
        world: Path, owner: str) -> None:
    scratch = world / "scratch"  # $TMPDIR, a results directory: never a runtime
    scratch.mkdir()
    os.chmod(scratch, 0o1777)
    kept = scratch / "results.txt"
    if owner == "self":
        scratch = _own_runtime(world)
        kept = scratch / "results.txt"
    kept.write_text("a week of training")
    os.chown(kept, NOBODY, NOBODY)

    def clean_it() -> None:
        os.environ["STAGEFS_RUNTIME"] = str(scratch)
        clean([Runtime()])

    code, msg = as_nobody(clean_it)
    # before: every file of the user in it removed, and "removed <dir>" said
    assert code == 1 and msg.startswith("ConfigError"), msg
    assert str(scratch) in msg and "not a stagefs runtime directory" in msg, msg
    assert kept.read_text() == "a week of training"


def test_clean_of_a_runtime_and_of_an_empty_directory_still_works(tmp_path: Path) -> None:
    rt = Runtime(str(tmp_path / "rt")).open()
    rt.unregister()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert clean([rt, Runtime(str(empty))]) == [rt.path, str(empty)]
    (tmp_path / "notes.txt").write_text("kept")
    with pytest.raises(ConfigError, match="not a stagefs runtime"):
        clean([Runtime(str(tmp_path))])  # holds files: never a runtime
    assert (tmp_path / "notes.txt").read_text() == "kept"


def test_mount_without_access_to_dev_fuse_says_so_and_points_to_run() -> None:
    from stagefs.posix import fuse

    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse on this machine")
    if os.stat("/dev/fuse").st_mode & 0o006 == 0o006:
        pytest.skip("/dev/fuse is open to every user here")

    def check() -> None:
        raise ConfigError(str(fuse.fuse_available()))

    code, msg = as_nobody(check)
    # before: None (a mount tried, then "the kernel refused the mount")
    assert code == 1 and "/dev/fuse cannot be opened" in msg and "stagefs run" in msg, msg


def test_a_runtime_directory_another_user_made_first_names_its_owner_and_a_way_out(
        world: Path) -> None:
    squatted = world / "stagefs-rt"  # /dev/shm/stagefs-<uid>, made first by another user
    squatted.mkdir(mode=0o777)
    os.chmod(squatted, 0o777)

    def open_it() -> None:
        Runtime(str(squatted)).open()

    code, msg = as_nobody(open_it)
    # before: "not a directory owned by you (uid 65534); remove it": nobody can remove it
    assert code == 1 and str(squatted) in msg and "root (uid 0) owns it" in msg, msg
    assert "STAGEFS_RUNTIME" in msg and "/stagefs-nobody" in msg, msg
