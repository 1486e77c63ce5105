"""The C accelerator and the Python reference give the same answers for every path form."""

from __future__ import annotations

import os

import pytest

import stagefs
from stagefs.namespace import Namespace

speedups = pytest.importorskip(
    "stagefs._speedups", reason="the C accelerator is not built (needs cc and libxxhash-dev)"
)


@pytest.fixture
def pack_dir(tmp_path):
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "a" / "x.txt").write_bytes(b"x" * 1000)
    (src / "a" / "b" / "y.bin").write_bytes(os.urandom(5000))
    (src / "e").write_bytes(b"")
    (src / "caf\u00e9 name").write_bytes(b"unicode")
    os.symlink("a/x.txt", src / "link")
    os.symlink("a", src / "dlink")
    with open(os.path.join(os.fsencode(src), b"\xff\xfe"), "wb") as f:
        f.write(b"raw name")
    stagefs.pack(src, tmp_path / "pack", progress=False)
    return tmp_path / "pack"


PATHS = [
    "a/x.txt", "a/b/y.bin", "e", "caf\u00e9 name", "link", "dlink/x.txt", "dlink/b/y.bin",
    "a", "a/b", "", "/a/x.txt", "a//x.txt", "./a/x.txt", "a/./x.txt", "a/../a/x.txt",
    "a/x.txt/", "nope", "a/nope", "a/x.txt/more", "\udcff\udcfe", b"a/x.txt", b"\xff\xfe",
    b"nope", ".", "..",
]


def outcome(fn, path):
    try:
        return fn(path)
    except OSError as exc:
        return (type(exc), exc.errno, exc.filename)


def test_stat_and_find_match_the_python_reference(pack_dir):
    with stagefs.open(pack_dir) as fs:
        ns = fs.namespace
        assert ns.accelerated
        for p in PATHS:
            assert outcome(ns.stat, p) == outcome(ns._stat_py, p), p
            # -1 from find() means "resolve the slow way"; any entry it returns must be right
            assert ns.find(p) in (-1, ns._find_py(p)), p
            plain = isinstance(p, str) and p and not p.startswith(("/", ".")) and "//" not in p
            surrogates = isinstance(p, str) and any(0xD800 <= ord(c) <= 0xDFFF for c in p)
            if plain and "/." not in p and not p.endswith("/") and not surrogates:
                assert ns.find(p) == ns._find_py(p), p
        for d, _, files in fs.walk(""):
            for f in files:
                p = os.path.join(d, f) if d else f
                assert ns.stat(p) == ns._stat_py(p)
                assert ns.stat(p).st_mtime == ns._stat_py(p).st_mtime


def test_disabled_by_environment(pack_dir, monkeypatch):
    monkeypatch.setenv("STAGEFS_SPEEDUPS", "0")
    with stagefs.open(pack_dir) as fs:
        assert not fs.namespace.accelerated
        assert fs.read("a/x.txt") == b"x" * 1000


def test_index_released_on_close(pack_dir):
    fs = stagefs.open(pack_dir)
    ns: Namespace = fs.namespace
    find = ns.find
    fs.close()
    assert find("a/x.txt") == -1  # released: no access to the unmapped manifest
