"""Property tests: random trees survive pack → unpack byte for byte; a stagefs file object
behaves like io.BytesIO over the same bytes."""

from __future__ import annotations

import io
import os
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stagefs
import stagefs.fileobj as fileobj
from conftest import random_bytes, snapshot_tree, text_bytes

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ----------------------------------------------------------------------------- random trees

SPECIAL_NAMES = [b"with space", b" lead", b"new\nline", b"-dash", b"--rf", b"x" * 255,
                 "ünïcödé".encode(), b"\xff\xfe\x80", b"tab\there", b".hidden", b"...",
                 b"a" * 200 + b"\xe9"]


def _ok_name(n: bytes) -> bool:
    return b"/" not in n and b"\x00" not in n and n not in (b".", b"..")


names = st.one_of(
    st.sampled_from(SPECIAL_NAMES),
    st.binary(min_size=1, max_size=255).filter(_ok_name),
    st.text("abcdefghij_-. \n", min_size=1, max_size=12).map(str.encode).filter(_ok_name),
)
sizes = st.one_of(st.integers(0, 64), st.integers(0, 5000), st.integers(0, 300_000))
file_modes = st.sampled_from([0o644, 0o600, 0o755, 0o444, 0o640])
dir_modes = st.sampled_from([0o755, 0o700, 0o750])
mtimes = st.integers(0, 2**33 * 10**9)  # 1970 .. 2242, nanoseconds


def _content(kind: str, size: int, seed: int) -> bytes:
    if kind == "random":
        return random_bytes(size, seed)
    if kind == "text":
        return text_bytes(size, seed)
    return b"\x00" * size


def _draw_tree(data: st.DataObject, root: bytes) -> None:
    """Create a random tree under ``root`` (which exists)."""
    dirs: list[bytes] = [root]
    entries: list[bytes] = []
    budget = data.draw(st.integers(1, 25), label="entries")
    for _ in range(budget):
        parent = data.draw(st.sampled_from(dirs), label="parent")
        name = data.draw(names, label="name")
        path = os.path.join(parent, name)
        if os.path.lexists(path) or len(path) > 3000:
            continue
        if data.draw(st.integers(0, 3), label="is_dir") == 0:
            os.mkdir(path)
            dirs.append(path)
        else:
            kind = data.draw(st.sampled_from(["random", "text", "zeros"]), label="kind")
            blob = _content(kind, data.draw(sizes, label="size"), len(entries))
            with open(path, "wb") as f:
                f.write(blob)
            os.chmod(path, data.draw(file_modes, label="mode"))
            ns = data.draw(mtimes, label="mtime")
            os.utime(path, ns=(ns, ns))
        entries.append(path)
    for i in range(data.draw(st.integers(0, 4), label="links")):
        parent = data.draw(st.sampled_from(dirs), label="link_parent")
        link = os.path.join(parent, b"link-%d" % i)
        if entries and data.draw(st.booleans(), label="resolves"):
            target = os.path.relpath(data.draw(st.sampled_from(entries), label="target"), parent)
        else:
            target = b"missing-%d" % i  # dangling, but inside the tree
        os.symlink(target, link)
        ns = data.draw(mtimes, label="link_mtime")
        os.utime(link, ns=(ns, ns), follow_symlinks=False)
        entries.append(link)
    for d in sorted(dirs, key=lambda p: -p.count(b"/")):  # deepest first
        os.chmod(d, data.draw(dir_modes, label="dir_mode"))
        ns = data.draw(mtimes, label="dir_mtime")
        os.utime(d, ns=(ns, ns))


@SETTINGS
@given(data=st.data(), shard_size=st.sampled_from([4096, 100_000, 2**20]),
       compress=st.sampled_from(["auto", "zstd", "none"]))
def test_pack_unpack_is_identity(data: st.DataObject, shard_size: int, compress: str) -> None:
    with tempfile.TemporaryDirectory(prefix="stagefs-prop-") as tmp:
        src = os.path.join(os.fsencode(tmp), b"src")
        os.mkdir(src)
        _draw_tree(data, src)
        before = snapshot_tree(src)
        pack, out = os.path.join(tmp, "pack"), os.path.join(tmp, "out")
        report = stagefs.pack(os.fsdecode(src), pack, shard_size=shard_size, compress=compress,
                              jobs=1, progress=False, echo=lambda _m: None)
        assert report.files == sum(1 for n in before.values() if n.kind == "file")
        assert report.raw_bytes == sum(len(n.content) for n in before.values()
                                       if n.kind == "file")
        stagefs.unpack(pack, out, progress=False)
        assert snapshot_tree(out) == before
        # the namespace agrees with the source's lstat, path by path
        with stagefs.open(pack) as fs:
            for rel, node in before.items():
                s = fs.lstat(rel)
                assert (s.st_mode, s.st_mtime_ns) == (node.mode, node.mtime_ns), rel
                if node.kind == "file":
                    assert fs.read(rel) == node.content
                    assert s.st_size == len(node.content)
                elif node.kind == "link":
                    assert os.fsencode(fs.readlink(rel)) == node.content
                real = os.path.join(src, rel) if rel else src
                assert fs.exists(rel) == os.path.exists(real), rel
                assert fs.isdir(rel) == os.path.isdir(real), rel
                assert fs.isfile(rel) == os.path.isfile(real), rel
                if os.path.exists(real):  # stat follows symlinks, as os.stat does
                    s, r = fs.stat(rel), os.stat(real)
                    assert (s.st_mode, s.st_mtime_ns) == (r.st_mode, r.st_mtime_ns), rel
            files = [rel for rel, n in before.items() if n.kind == "file"]
            assert fs.read_many(files) == [before[r].content for r in files]


# ----------------------------------------------------------------------------- file objects

FILES: dict[str, bytes] = {
    "empty": b"",
    "one": b"x",
    "nl": b"\n",
    "lines": b"".join(b"line %d %s\n" % (i, b"y" * (i % 37)) for i in range(400)),
    "no_trailing_nl": b"first\nsecond\nthird",
    "crlf": b"a\r\nb\r\n\r\nc",
    "binary": random_bytes(20_000, 7),
    "long_lines": b"\n".join(random_bytes(3000, i).replace(b"\n", b"") for i in range(5)),
}


@pytest.fixture(scope="module")
def fileobj_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The FILES, stored raw (the large path reads by range only from raw files)."""
    base = tmp_path_factory.mktemp("fileobj")
    for name, blob in FILES.items():
        (base / "src").mkdir(exist_ok=True)
        (base / "src" / name).write_bytes(blob)
    stagefs.pack(base / "src", base / "pack", compress="none", shard_size=8192, jobs=1,
                 progress=False, echo=lambda _m: None)
    return base / "pack"


def _size(blob: bytes) -> st.SearchStrategy[int]:
    return st.integers(-3, len(blob) + 10)


def _ops(blob: bytes) -> st.SearchStrategy[list[tuple[Any, ...]]]:
    n = len(blob)
    op = st.one_of(
        st.tuples(st.just("read"), st.one_of(st.none(), _size(blob))),
        st.tuples(st.just("read_all")),
        st.tuples(st.just("read1"), st.integers(-1, n + 10)),
        st.tuples(st.just("readline"), st.one_of(st.none(), _size(blob))),
        st.tuples(st.just("readlines"), st.one_of(st.none(), _size(blob))),
        st.tuples(st.just("seek"), st.integers(-n - 5, n + 5), st.sampled_from([0, 1, 2])),
        st.tuples(st.just("tell")),
        st.tuples(st.just("readinto"), st.integers(0, n + 10)),
        st.tuples(st.just("next")),
        st.tuples(st.just("iterate")),
    )
    return st.lists(op, max_size=25)


def _apply(f: Any, op: tuple[Any, ...]) -> Any:
    name, *args = op
    if name == "read_all":
        return f.read()
    if name == "readinto":
        buf = bytearray(b"\xee" * args[0])
        return f.readinto(buf), bytes(buf)
    if name == "next":
        return next(f, "StopIteration")
    if name == "iterate":
        return list(f)
    return getattr(f, name)(*args)


def _outcome(f: Any, op: tuple[Any, ...]) -> tuple[str, Any]:
    try:
        return "ok", _apply(f, op)
    except (ValueError, OSError) as exc:
        return "error", type(exc).__name__


def _check_like_bytesio(fs: stagefs.Store, name: str, ops: list[tuple[Any, ...]],
                        buffering: int, expect_class: type) -> None:
    model = io.BytesIO(FILES[name])
    with fs.open(name, "rb", buffering) as f:
        assert isinstance(f, expect_class)
        for op in ops:
            if op[0] == "read1":  # may return less than asked (one raw read): a prefix
                start, got1 = model.tell(), f.read1(op[1])
                want1 = model.read1(op[1])
                assert want1.startswith(got1) and (got1 or not want1), op
                model.seek(start + len(got1))
                continue
            want, got = _outcome(model, op), _outcome(f, op)
            if want[0] == "error":
                assert got[0] == "error", (op, got)
            else:
                assert got == want, op
            assert f.tell() == model.tell(), op
        assert f.read() == model.read()


@pytest.fixture(scope="module")
def fileobj_store(fileobj_pack: Path) -> Iterator[stagefs.Store]:
    with stagefs.open(fileobj_pack) as fs:
        yield fs


@settings(max_examples=300, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(FILES)))
def test_small_file_behaves_like_bytesio(fileobj_store: stagefs.Store, data: st.DataObject,
                                         name: str) -> None:
    ops = data.draw(_ops(FILES[name]))
    _check_like_bytesio(fileobj_store, name, ops, -1, fileobj.SmallFile)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(n for n in FILES if FILES[n])),
       buffering=st.sampled_from([-1, 2, 7, 64, 4096]))
def test_large_file_behaves_like_bytesio(fileobj_store: stagefs.Store, data: st.DataObject,
                                         name: str, buffering: int) -> None:
    ops = data.draw(_ops(FILES[name]))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fileobj, "WHOLE_READ_LIMIT", 0)
        _check_like_bytesio(fileobj_store, name, ops, buffering, fileobj.LargeFile)


def test_large_file_verifies_a_sequential_read(fileobj_store: stagefs.Store,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fileobj, "WHOLE_READ_LIMIT", 0)
    rng = random.Random(1)
    for name, blob in FILES.items():
        if not blob:
            continue
        with fileobj_store.open(name, buffering=16) as f:
            parts = []
            while chunk := f.read(rng.randint(1, 999)):
                parts.append(chunk)
        assert b"".join(parts) == blob
