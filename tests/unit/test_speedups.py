"""The C accelerator and the Python reference give the same answers for every path form."""

from __future__ import annotations

import os
import random

import pytest
import xxhash

import stagefs
from stagefs.namespace import Namespace

speedups = pytest.importorskip(
    "stagefs._speedups", reason="the C accelerator is not built (needs a C compiler)"
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
            plain = isinstance(p, str) and p.lstrip("/")[:1] not in ("", ".") and "//" not in p
            surrogates = isinstance(p, str) and any(0xD800 <= ord(c) <= 0xDFFF for c in p)
            if plain and "/." not in p and not p.endswith("/") and not surrogates:
                assert ns.find(p) == ns._find_py(p), p
        for d, _, files in fs.walk(""):
            for f in files:
                p = os.path.join(d, f) if d else f
                assert ns.stat(p) == ns._stat_py(p)
                assert ns.stat(p).st_mtime == ns._stat_py(p).st_mtime


def test_paths_from_the_root_take_the_fast_path(pack_dir):
    """"/a/x.txt" (what walk("/") gives) is the file "a/x.txt": both lookups find it without
    the component-by-component resolution, which cost a batch of small files a third of its
    time; "/" alone, "//a" and "/./a" still go the slow way."""
    with stagefs.open(pack_dir) as fs:
        ns = fs.namespace
        for p in ("/a/x.txt", "/a/b/y.bin", b"/a/x.txt", "/e"):
            want = ns._find_py(p.lstrip("/") if isinstance(p, str) else p.lstrip(b"/"))
            assert want >= 0
            assert ns.find(p) == ns._find_py(p) == want, p
            assert ns.stat(p) == ns._stat_py(p)
        for p in ("/", "//a/x.txt", "/./a/x.txt", "/a/x.txt/"):
            assert ns.find(p) == -1 == ns._find_py(p), p
        assert fs.read("/a/x.txt") == fs.read("a/x.txt")
        assert fs.read_many(["/a/x.txt", "a/b/y.bin"]) == [fs.read("a/x.txt"),
                                                             fs.read("/a/b/y.bin")]
        root = [os.path.join(d, f) for d, _, files in fs.walk("/") for f in files]
        assert root and all(p.startswith("/") for p in root)
        # a name not in UTF-8 (surrogates) is the Python path's alone (-1: the slow way)
        assert all(ns.find(p) == ns._find_py(p) for p in root
                   if not any(0xD800 <= ord(c) <= 0xDFFF for c in p))


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


# every length where XXH3 switches branch, and the stripe/block edges of the long loop
_EDGES = [0, 1, 3, 4, 8, 9, 16, 17, 32, 33, 64, 65, 96, 97, 128, 129, 144, 239, 240, 241, 255,
          256, 1023, 1024, 1025, 1088, 2047, 2048, 2049, 3072, 4096 + 63, 65536, 100_003]


def test_hash_equals_xxhash_at_every_length():
    rnd = random.Random(19)
    lengths = list(range(1025)) + _EDGES + [rnd.randrange(1025, 50_000) for _ in range(40)]
    for n in lengths:
        for _ in range(3):
            data = rnd.randbytes(n)
            assert speedups.xxh3_64(data) == xxhash.xxh3_64_intdigest(data), n
    for n in _EDGES:  # bytes that are all 0x00 or all 0xff: carries and overflows at the limit
        for fill in (b"\x00", b"\xff"):
            assert speedups.xxh3_64(fill * n) == xxhash.xxh3_64_intdigest(fill * n), (n, fill)


def test_hash_takes_any_buffer():
    data = bytearray(os.urandom(300))
    assert speedups.xxh3_64(memoryview(data)[7:]) == xxhash.xxh3_64_intdigest(bytes(data[7:]))
    with pytest.raises(TypeError):
        speedups.xxh3_64("text")


def test_lookups_of_paths_of_every_length_match_the_python_path(tmp_path):
    """Names of 1..255 bytes and paths past 1024 bytes: each found by the C index (whose hash
    must equal the one the manifest was written with) at the entry the Python path finds."""
    src = tmp_path / "src"
    rnd = random.Random(5)
    names = ["n" * k for k in range(1, 256)]
    flat = src / "flat"
    flat.mkdir(parents=True)
    for name in names:
        (flat / name).write_bytes(name.encode()[:3])
    deep = src.joinpath(*[f"{k:02d}" + "d" * 200 for k in range(6)])  # about 1230 bytes
    deep.mkdir(parents=True)
    for k in range(20):
        (deep / ("f" * rnd.randrange(1, 255) + str(k))).write_bytes(b"x")
    stagefs.pack(src, tmp_path / "pack", progress=False)
    with stagefs.open(tmp_path / "pack") as fs:
        ns = fs.namespace
        assert ns.accelerated
        paths = [os.path.join(d, f) if d else f for d, _, files in fs.walk("") for f in files]
        assert len(paths) == 255 + 20 and max(len(p) for p in paths) > 1024
        for p in paths:
            e = ns.find(p)
            assert e != -1 and e == ns._find_py(p), p
            assert ns.stat(p) == ns._stat_py(p), p
            assert ns.find(p + "x") == -1 == ns._find_py(p + "x")
