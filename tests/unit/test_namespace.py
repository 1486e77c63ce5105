"""The namespace answers stat, listdir, scandir and walk exactly as the source tree's file
system does, from the manifest alone."""

from __future__ import annotations

import errno
import os
import stat as st
from pathlib import Path

import pytest

import stagefs
from stagefs.errors import StagefsError
from stagefs.namespace import normalize

Sample = tuple[Path, Path]

ALL_PATHS = [
    "", "a.txt", "empty.bin", "img", "img/cat.jpg", "img/dog.jpg", "img/up", "data",
    "data/arr.npy", "data/rand.bin", "data/nested", "data/nested/deep", "data/nested/deep/x",
    "emptydir", "we ird name.txt", "-dash", "exec.sh", "link_file", "link_dir", "link_chain",
    "link_dangling", "link_dir/cat.jpg", "link_dir/up", "data/nested/../arr.npy",
]
LINKS = ["link_file", "link_dir", "link_chain", "link_dangling", "img/up", "link_dir/up"]


def _src(sample: Sample, rel: str) -> str:
    return os.path.join(sample[0], rel) if rel else str(sample[0])


def _same_stat(ours: os.stat_result, real: os.stat_result, what: str) -> None:
    assert ours.st_mode == real.st_mode, what
    assert st.S_IFMT(ours.st_mode) == st.S_IFMT(real.st_mode), what
    assert ours.st_mtime_ns == real.st_mtime_ns, what
    assert ours.st_mtime == real.st_mtime, what
    assert ours.st_nlink == real.st_nlink, what
    if not st.S_ISDIR(real.st_mode):  # a directory's size is the file system's own business
        assert ours.st_size == real.st_size, what
    assert ours.st_blocks == (ours.st_size + 511) // 512


@pytest.mark.parametrize("rel", [p for p in ALL_PATHS if p != "link_dangling"])
def test_stat_equals_os_stat(sample_pack_session: Sample, sample_store: stagefs.Store,
                             rel: str) -> None:
    _same_stat(sample_store.stat(rel), os.stat(_src(sample_pack_session, rel)), rel)


@pytest.mark.parametrize("rel", ALL_PATHS)
def test_lstat_equals_os_lstat(sample_pack_session: Sample, sample_store: stagefs.Store,
                               rel: str) -> None:
    _same_stat(sample_store.lstat(rel), os.lstat(_src(sample_pack_session, rel)), rel)


def test_stat_result_is_complete(sample_store: stagefs.Store) -> None:
    s = sample_store.stat("a.txt")
    assert isinstance(s, os.stat_result)
    assert s.st_uid == os.getuid() and s.st_gid == os.getgid()
    assert s.st_ino > 0 and s.st_ino != sample_store.stat("img").st_ino
    assert s.st_dev == sample_store.stat("img").st_dev
    assert s[st.ST_SIZE] == s.st_size == 5000
    assert s.st_atime_ns == s.st_ctime_ns == s.st_mtime_ns


@pytest.mark.parametrize("rel", ALL_PATHS)
def test_predicates_equal_os_path(sample_pack_session: Sample, sample_store: stagefs.Store,
                                  rel: str) -> None:
    real = _src(sample_pack_session, rel)
    fs = sample_store
    assert fs.exists(rel) == os.path.exists(real), rel
    assert fs.isdir(rel) == os.path.isdir(real), rel
    assert fs.isfile(rel) == os.path.isfile(real), rel
    assert fs.islink(rel) == os.path.islink(real), rel
    if os.path.exists(real):
        assert fs.getsize(rel) == os.path.getsize(real) or os.path.isdir(real)


@pytest.mark.parametrize("rel", ["nope", "img/nope", "a.txt/x", "nope/deeper", "link_dangling/x"])
def test_predicates_of_missing_paths(sample_store: stagefs.Store, rel: str) -> None:
    fs = sample_store
    assert not fs.exists(rel) and not fs.isdir(rel) and not fs.isfile(rel)
    assert not fs.islink(rel)


@pytest.mark.parametrize("rel", LINKS)
def test_readlink_equals_os_readlink(sample_pack_session: Sample, sample_store: stagefs.Store,
                                     rel: str) -> None:
    assert sample_store.readlink(rel) == os.readlink(_src(sample_pack_session, rel))


def test_readlink_of_non_link(sample_store: stagefs.Store) -> None:
    with pytest.raises(OSError) as info:
        sample_store.readlink("a.txt")
    assert info.value.errno == errno.EINVAL and "a.txt" in str(info.value)
    assert isinstance(info.value, StagefsError)


@pytest.mark.parametrize("rel", ["", "img", "data", "data/nested", "emptydir", "link_dir"])
def test_listdir_equals_os_listdir(sample_pack_session: Sample, sample_store: stagefs.Store,
                                   rel: str) -> None:
    real = sorted(os.listdir(_src(sample_pack_session, rel)))
    ours = sample_store.listdir(rel)
    assert ours == sorted(ours)  # stagefs lists in name order
    assert ours == real


@pytest.mark.parametrize("rel", ["", "img", "data", "emptydir", "link_dir"])
def test_scandir_equals_os_scandir(sample_pack_session: Sample, sample_store: stagefs.Store,
                                   rel: str) -> None:
    with os.scandir(_src(sample_pack_session, rel)) as it:
        real = {d.name: d for d in it}
    ours = {d.name: d for d in sample_store.scandir(rel)}
    assert ours.keys() == real.keys()
    for name, d in ours.items():
        r = real[name]
        assert d.path == (f"{rel}/{name}" if rel else name)
        assert os.fspath(d) == d.path
        assert d.is_symlink() == r.is_symlink(), name
        for follow in (True, False):
            assert d.is_dir(follow_symlinks=follow) == r.is_dir(follow_symlinks=follow), name
            assert d.is_file(follow_symlinks=follow) == r.is_file(follow_symlinks=follow), name
        _same_stat(d.stat(follow_symlinks=False), r.stat(follow_symlinks=False), name)
        if os.path.exists(r.path):
            _same_stat(d.stat(), r.stat(), name)
        else:
            with pytest.raises(FileNotFoundError):
                d.stat()


def _os_walk(root: Path, topdown: bool, followlinks: bool) -> list[tuple[str, list[str],
                                                                           list[str]]]:
    out = []
    for top, dirs, files in os.walk(root, topdown=topdown, followlinks=followlinks):
        rel = os.path.relpath(top, root)
        out.append(("" if rel == "." else rel, sorted(dirs), sorted(files)))
    return out


@pytest.mark.parametrize("topdown", [True, False])
@pytest.mark.parametrize("followlinks", [True, False])
def test_walk_equals_os_walk(sample_pack_session: Sample, sample_store: stagefs.Store,
                             topdown: bool, followlinks: bool) -> None:
    real = _os_walk(sample_pack_session[0], topdown, followlinks)
    ours = [(t, sorted(d), sorted(f)) for t, d, f in
            sample_store.walk("", topdown=topdown, followlinks=followlinks)]
    assert sorted(ours) == sorted(real)
    # the order constraint of os.walk: a directory before (topdown) or after its children
    pos = {t: i for i, (t, _, _) in enumerate(ours)}
    for t, dirs, _ in ours:
        for d in dirs:
            child = f"{t}/{d}" if t else d
            if child in pos:
                assert (pos[t] < pos[child]) == topdown


def test_walk_subtree_and_pruning(sample_store: stagefs.Store) -> None:
    assert [t for t, _, _ in sample_store.walk("data")] == ["data", "data/nested",
                                                             "data/nested/deep"]
    seen = []
    for top, dirs, _ in sample_store.walk(""):
        seen.append(top)
        dirs[:] = [d for d in dirs if d != "data"]
    assert not any(s.startswith("data") for s in seen)
    assert list(sample_store.walk("nope")) == list(os.walk("/nonexistent-stagefs"))
    assert list(sample_store.walk("a.txt")) == []


@pytest.mark.parametrize(
    ("given", "same_as"),
    [("/a.txt", "a.txt"), ("img/", "img"), ("img//cat.jpg", "img/cat.jpg"),
     ("./a.txt", "a.txt"), ("img/../a.txt", "a.txt"), ("/", ""), (".", ""), ("//img///", "img"),
     ("data/./nested/deep/../deep/x", "data/nested/deep/x"), ("../../a.txt", "a.txt"),
     (b"img/cat.jpg", "img/cat.jpg"), (Path("img") / "cat.jpg", "img/cat.jpg")],
)
def test_path_normalization(sample_store: stagefs.Store, given: str | bytes | Path,
                            same_as: str) -> None:
    assert sample_store.stat(given) == sample_store.stat(same_as)
    assert sample_store.exists(given)


def test_normalize_function() -> None:
    assert normalize("a//b/./c/") == b"a/b/c"
    assert normalize("/") == b"" and normalize("") == b""
    assert normalize("a/../../b") == b"b"
    assert normalize(b"\xff/x") == b"\xff/x"
    assert normalize("..a/.b") == b"..a/.b"  # dots inside names are names


def test_symlinks_resolve_like_the_kernel(sample_pack_session: Sample,
                                          sample_store: stagefs.Store) -> None:
    fs = sample_store
    assert fs.read("link_file") == fs.read("a.txt") == fs.read("link_chain")
    assert fs.read("link_dir/cat.jpg") == fs.read("img/cat.jpg")
    assert fs.read("img/up") == fs.read("data/arr.npy") == fs.read("link_dir/up")
    assert fs.listdir("link_dir") == fs.listdir("img")
    assert fs.stat("link_dir") == fs.stat("img")
    assert fs.lstat("link_dir") != fs.stat("link_dir")
    real = os.stat(_src(sample_pack_session, "link_chain"))
    _same_stat(fs.stat("link_chain"), real, "chain")


def test_dangling_symlink(sample_store: stagefs.Store) -> None:
    fs = sample_store
    assert fs.islink("link_dangling") and not fs.exists("link_dangling")
    for call in (fs.stat, fs.read, fs.listdir, fs.open):
        with pytest.raises(FileNotFoundError, match="link_dangling") as info:
            call("link_dangling")
        assert isinstance(info.value, StagefsError)
        assert info.value.errno == errno.ENOENT
    assert fs.lstat("link_dangling").st_size == len("nowhere")


def test_symlink_loop_is_eloop(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    os.symlink("b", src / "a")
    os.symlink("a", src / "b")
    os.symlink("self", src / "self")
    (src / "d").mkdir()
    stagefs.pack(src, tmp_path / "pack", jobs=1, progress=False, echo=lambda _m: None)
    with stagefs.open(tmp_path / "pack") as fs:
        # listing a directory that holds a loop terminates, and says what os says
        # (os.DirEntry.is_dir raises ELOOP here; stagefs says False, as os.walk concludes)
        ours = sorted((d.name, d.is_dir(), d.is_file(), d.is_symlink()) for d in fs.scandir())
        assert ours == [("a", False, False, True), ("b", False, False, True),
                        ("d", True, False, False), ("self", False, False, True)]
        assert sorted(fs.walk("")) == sorted(
            (os.path.relpath(t, src).replace(".", ""), sorted(d), sorted(f))
            for t, d, f in os.walk(src))
        for name in ("a", "b", "self"):
            with pytest.raises(OSError) as real:
                os.stat(src / name)
            with pytest.raises(OSError, match=name) as ours:
                fs.stat(name)
            assert ours.value.errno == real.value.errno == errno.ELOOP
            assert isinstance(ours.value, StagefsError)
            assert fs.islink(name) and not fs.exists(name)
            with pytest.raises(OSError) as ours:
                fs.read(f"{name}/x")
            assert ours.value.errno == errno.ELOOP


@pytest.mark.parametrize(
    ("call", "path", "exc", "code"),
    [
        ("stat", "nope", FileNotFoundError, errno.ENOENT),
        ("stat", "img/nope/deeper", FileNotFoundError, errno.ENOENT),
        ("listdir", "nope", FileNotFoundError, errno.ENOENT),
        ("listdir", "a.txt", NotADirectoryError, errno.ENOTDIR),
        ("listdir", "link_file", NotADirectoryError, errno.ENOTDIR),
        ("stat", "a.txt/x", NotADirectoryError, errno.ENOTDIR),
        ("read", "img", IsADirectoryError, errno.EISDIR),
        ("read", "link_dir", IsADirectoryError, errno.EISDIR),
        ("read", "", IsADirectoryError, errno.EISDIR),
        ("read", "nope.jpg", FileNotFoundError, errno.ENOENT),
        ("open", "img", IsADirectoryError, errno.EISDIR),
        ("open", "nope", FileNotFoundError, errno.ENOENT),
        ("getsize", "nope", FileNotFoundError, errno.ENOENT),
        ("read_many", "img", IsADirectoryError, errno.EISDIR),
        ("scandir", "a.txt", NotADirectoryError, errno.ENOTDIR),
        ("lstat", "nope", FileNotFoundError, errno.ENOENT),
    ],
)
def test_errors_are_builtin_and_stagefs(sample_pack_session: Sample, sample_store: stagefs.Store,
                                        call: str, path: str, exc: type[OSError],
                                        code: int) -> None:
    fn = getattr(sample_store, call)
    with pytest.raises(exc) as info:
        if call == "read_many":
            fn(["a.txt", path])
        elif call == "scandir":
            list(fn(path))
        else:
            fn(path)
    err = info.value
    assert isinstance(err, StagefsError) and isinstance(err, OSError)
    assert err.errno == code
    assert path in str(err) and err.filename == path
    # the real file system says the same
    real = _src(sample_pack_session, path)
    read = Path.read_bytes
    os_call = {"read": read, "open": read, "read_many": read,
               "scandir": lambda p: list(os.scandir(p)), "getsize": os.path.getsize}
    with pytest.raises(exc):
        (os_call[call] if call in os_call else getattr(os, call))(Path(real))


def test_directory_nlink_counts_subdirectories(sample_pack_session: Sample,
                                               sample_store: stagefs.Store) -> None:
    for rel in ("", "data", "data/nested", "img", "emptydir"):
        assert sample_store.stat(rel).st_nlink == os.stat(_src(sample_pack_session, rel)).st_nlink


def test_unusual_names(tmp_path: Path) -> None:
    src = os.fsencode(tmp_path / "src")
    os.mkdir(src)
    names = [b"line\nbreak", b"-rf", b" lead space", b"tab\tname", b"\xff\xfe bytes",
             "ünïcödé".encode(), b"x" * 255, b"..dots", b"star*?[]", b"back\\slash"]
    for i, n in enumerate(names):
        with open(os.path.join(src, n), "wb") as f:
            f.write(bytes([i]) * i)
    os.mkdir(os.path.join(src, b"d\n\xfe"))
    with open(os.path.join(src, b"d\n\xfe", b"in"), "wb") as f:
        f.write(b"inner")
    stagefs.pack(os.fsdecode(src), tmp_path / "pack", jobs=1, progress=False,
                 echo=lambda _m: None)
    with stagefs.open(tmp_path / "pack") as fs:
        assert sorted(fs.listdir("")) == sorted(os.listdir(os.fsdecode(src)))
        for i, n in enumerate(names):
            assert fs.read(n) == bytes([i]) * i
            assert fs.read(os.fsdecode(n)) == bytes([i]) * i
        assert fs.read(b"d\n\xfe/in") == b"inner"
        assert fs.read(os.fsdecode(b"d\n\xfe/in")) == b"inner"
        assert fs.listdir(b"d\n\xfe") == [b"in"]  # bytes in, bytes out, as os.listdir


def test_walk_following_a_loop_stops_like_os_walk(tmp_path: Path) -> None:
    """d/up -> .. : with followlinks, os.walk descends until the kernel's 40-link limit
    (ELOOP); stagefs stops at the same depth instead of recursing without end."""
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f").write_bytes(b"f")
    os.symlink("..", src / "d" / "up")
    stagefs.pack(src, tmp_path / "pack", jobs=1, progress=False, echo=lambda _m: None)
    real = []
    for top, _, _ in os.walk(src, followlinks=True):
        rel = os.path.relpath(top, src)
        real.append("" if rel == "." else rel)
    with stagefs.open(tmp_path / "pack") as fs:
        ours = [top for top, _, _ in fs.walk("", followlinks=True)]
        assert sorted(ours) == sorted(real)
        deep = "d/up/" * 40 + "d/f"
        assert fs.read(deep) == b"f" == (src / deep).read_bytes()
        for path in ("d/up/" * 41 + "d/f", "d/up/" * 40 + "d/up"):
            with pytest.raises(OSError) as info:
                fs.stat(path)
            assert info.value.errno == errno.ELOOP and isinstance(info.value, StagefsError)
            with pytest.raises(OSError) as info:
                os.stat(src / path)
            assert info.value.errno == errno.ELOOP


def test_dotdot_trailing_slash_and_bytes_like_the_kernel(tmp_path: Path) -> None:
    """".." is the parent of the directory reached (through a symlink too), a trailing "/"
    needs a directory, and bytes paths list as bytes: each as os does on the source."""
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "a" / "b" / "f").write_bytes(b"f")
    (src / "a" / "sib").write_bytes(b"sib")
    (src / "top").write_bytes(b"top")
    os.symlink("a/b", src / "lk")
    stagefs.pack(src, tmp_path / "pack", jobs=1, progress=False)

    def outcome(fn, *args):  # type: ignore[no-untyped-def]
        try:
            r = fn(*args)
        except OSError as exc:
            return exc.errno
        return r.st_size if isinstance(r, os.stat_result) and not st.S_ISDIR(r.st_mode) else (
            "dir" if isinstance(r, os.stat_result) else r)

    with stagefs.open(tmp_path / "pack") as fs:
        for p in ["lk/../sib", "lk/../top", "top/", "a/", "lk/", "a/b/f/", "a/../top", "lk/f",
                  "lk/..", "a/b/../../top", "top/..", "lk/f/.."]:
            assert outcome(fs.stat, p) == outcome(os.stat, f"{src}/{p}"), p
            assert outcome(fs.lstat, p) == outcome(os.lstat, f"{src}/{p}"), p
        assert fs.stat("../../top") == fs.stat("top")  # the root is "/" to the dataset
        assert fs.listdir(b"a") == sorted(os.listdir(os.fsencode(src / "a")))
        assert [d.name for d in fs.scandir(b"a")] == [b"b", b"sib"]
        assert list(fs.walk(b"a")) == [(b"a", [b"b"], [b"sib"]), (b"a/b", [], [b"f"])]
