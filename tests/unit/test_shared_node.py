"""A node shared by several users and jobs, seen by an unprivileged user (``as_nobody``):
a dataset another user keeps private, a tier directory shared by users (``/dev/shm``
itself, a scratch directory), a runtime variable naming a directory of another use, and a
node without FUSE for this user. Each is a clear error that names the thing and says what
to do, or works; never a traceback from deep inside, a lie, or another user's data touched.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import stagefs
from conftest import as_nobody, build_sample_tree, world_dir
from stagefs.errors import ConfigError
from stagefs.format import KIND_FILE
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


def _stages_everything(runtime: Path, pack: Path, tier: str) -> Callable[[], None]:
    """A child's work: stage every shard of ``pack`` into ``tier`` with the runtime
    ``runtime``; an AssertionError unless every shard is held and no tier stopped."""

    def stage() -> None:
        os.environ["STAGEFS_RUNTIME"] = str(runtime)
        with stagefs.open(pack, tiers=[tier]) as fs:
            n = len(fs.manifest.shards)
            fs.chain.stage(list(range(n)))
            held, stopped = fs.held_shards(), [t.stopped for t in fs.chain.tiers]
            if len(held) != n or any(stopped):
                raise AssertionError(f"held {sorted(held)} of {n}; stopped: {stopped}")

    return stage


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

    code, msg = as_nobody(_stages_everything(mine / "rt", pack, f"{tier}:64MiB"))
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


@pytest.mark.parametrize("parent_is", ["another_users", "world_writable"])
@pytest.mark.parametrize("opener", ["reader", "daemon"])
def test_a_runtime_in_a_directory_another_user_may_rename_in_is_refused(
        world: Path, parent_is: str, opener: str) -> None:
    from stagefs.cluster.cmap import prepare_runtime

    # the docs' /dev/shm/stagefs-$USER, made first by another user, or a directory any user
    # may write without the sticky bit: that user may move the runtime away (the daemon's
    # readers then wait for its map forever) or put one of theirs in its place
    parent = world / "stagefs-nobody"
    parent.mkdir()
    os.chmod(parent, 0o777)
    if parent_is == "another_users":
        os.chown(parent, 12345, 12345)
    runtime = parent / "job42"

    def open_it() -> None:
        if opener == "reader":
            Runtime(str(runtime)).open()
        else:
            prepare_runtime(str(runtime))

    code, msg = as_nobody(open_it)
    # before: made job42 there, and used it
    assert code == 1 and f"{parent} " in msg and "may move the runtime directory" in msg, msg
    assert ("uid 12345" if parent_is == "another_users" else "every user") in msg, msg
    assert "STAGEFS_RUNTIME" in msg and "mktemp -d" in msg, msg
    assert not runtime.exists()


@pytest.mark.parametrize("squat", ["copy_symlink", "copy_file", "tier_symlink", "tier_theirs"])
def test_a_name_another_user_made_first_in_a_shared_tier_is_never_placed_through(
        world: Path, squat: str) -> None:
    pack = _pack(world)
    with stagefs.open(pack) as fs:
        pack_id = fs.manifest.pack_id.hex()
    tier = world / "scratch"  # shared by users (/dev/shm), sticky
    tier.mkdir()
    os.chmod(tier, 0o1777)
    mine = _own_runtime(world)
    elsewhere = mine / "elsewhere"  # a directory of the reader's, where the squatter points
    elsewhere.mkdir()
    os.chown(elsewhere, NOBODY, NOBODY)
    named = tier  # the tier the reader names
    if squat == "copy_symlink":
        (tier / pack_id).symlink_to(elsewhere)
        os.lchown(tier / pack_id, 12345, 12345)
    elif squat == "copy_file":
        (tier / pack_id).write_bytes(b"")
        os.chown(tier / pack_id, 12345, 12345)
    elif squat == "tier_symlink":
        named = tier / "t-nobody"  # the reader's tier, named before it made it
        named.symlink_to(elsewhere)
        os.lchown(named, 12345, 12345)
    else:
        named = tier / "t-nobody"  # made first as a directory every user may write
        named.mkdir()
        os.chmod(named, 0o777)
        os.chown(named, 12345, 12345)

    def reader() -> None:
        os.environ["STAGEFS_RUNTIME"] = str(mine / "rt")
        with stagefs.open(pack, tiers=[f"{named}:64MiB"]) as fs:
            fs.chain.stage(list(range(len(fs.manifest.shards))))

    code, msg = as_nobody(reader)
    # before: copies placed in `elsewhere` (where the squatter chose; clean never removes
    # them) for a symlink, a FileExistsError from inside for a file, and copies in a
    # directory of theirs, which they could swap for one where they read what is written
    assert code == 1 and msg.startswith("ConfigError") and "uid 12345" in msg, msg
    assert "symlink" in msg or "not a directory" in msg or "may move" in msg, msg
    assert os.listdir(elsewhere) == []


@pytest.mark.parametrize("kind", ["file", "fifo"])
def test_a_file_another_user_made_under_the_runtime_name_names_its_owner(
        world: Path, kind: str) -> None:
    squatted = world / "stagefs-rt"  # /dev/shm/stagefs-<uid>, made first as a file or FIFO
    if kind == "fifo":
        os.mkfifo(squatted, 0o666)
    else:
        squatted.write_bytes(b"")
    os.chown(squatted, 12345, 12345)
    code, msg = as_nobody(lambda: Runtime(str(squatted)).open())
    # before: "cannot create it (File exists)", naming no one
    assert code == 1 and str(squatted) in msg and "uid 12345" in msg, msg
    assert "STAGEFS_RUNTIME" in msg, msg


def test_another_users_files_in_a_shared_tier_take_none_of_this_users_room(
        world: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pack = _pack(world)
    tier = world / "scratch"  # shared by users (/dev/shm), sticky
    tier.mkdir()
    os.chmod(tier, 0o1777)
    theirs = tier / "theirs"  # another user's readable directory: one 1 MiB file, 64 links
    theirs.mkdir(mode=0o755)
    (theirs / "f0").write_bytes(os.urandom(2**20))
    for i in range(1, 64):
        os.link(theirs / "f0", theirs / f"f{i}")
    (tier / "top").write_bytes(os.urandom(2**20))  # and a file of theirs at the top
    mine = _own_runtime(world)

    code, msg = as_nobody(_stages_everything(mine / "rt", pack, f"{tier}:8MiB"))
    # before: their 65 MiB counted against this user's 8 MiB: nothing placed
    assert code == 0, msg


def test_a_shard_another_user_made_unreadable_says_so_and_what_to_do(world: Path) -> None:
    """One shard of a readable pack made unreadable by its owner (``chmod 000``) while a job
    of another user reads it cold: the read names the shard, says that its mode keeps this
    user out and how the owner makes the pack readable. Before, only "Permission denied",
    then "Is the shared file system mounted and the dataset there?"."""
    pack = _pack(world)
    mine = _own_runtime(world)
    with stagefs.open(pack) as fs:
        m = fs.manifest
        shard = m.shards[-1].name
        victim = next(os.fsdecode(m.path_of(e)) for e in range(len(m.size))
                      if m.kind[e] == KIND_FILE and int(m.shard[e]) == len(m.shards) - 1)
    os.chmod(pack / shard, 0)

    def reader() -> None:
        os.environ["STAGEFS_RUNTIME"] = str(mine / "rt")
        with stagefs.open(pack, tiers=[f"{mine / 'tier'}:64MiB"]) as fs:
            fs.read(victim)

    code, msg = as_nobody(reader)
    assert code == 1 and msg.startswith("OriginUnavailableError"), msg
    assert str(pack / shard) in msg and "not readable by nobody" in msg, msg
    assert f"chmod -R a+rX {pack}" in msg, msg
    assert "Is the shared file system mounted" not in msg, msg  # not its cause
