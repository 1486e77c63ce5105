"""Fuzz: mutated manifests (arrays, hash table, names, JSON metadata; body checksum
recomputed) and mutated shards, through every reader, each case in a child process with a
time limit. Allowed: the right bytes, or a StagefsError; never a hang, never another
exception (IndexError, OverflowError, RecursionError, numpy's ValueError...).

The default run is short; a longer one: ``FUZZ_EXAMPLES=5000 pytest tests/unit/test_hostile_fuzz.py
--hypothesis-show-statistics``."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import stagefs
from hostile_packs import FILES, LINKS, ManifestBytes, run_bounded, write_base_pack
from stagefs.cli import main
from stagefs.errors import StagefsError
from stagefs.format import MANIFEST_NAME, NO_INDEX, Manifest
from stagefs.format.shard import shard_name
from stagefs.verify import verify_pack

LIMIT = 60.0  # seconds for one case (all readers): far above a real run of one (< 1 s)
PATHS = sorted({b"", b"ab", b"img", b"deep", b"deep/er", b"empty", *FILES, *LINKS})
PROBES = [*PATHS, b"nope", b"ab/nope", b"ab/../img/up", b"link/", b"a.txt/x", b"..",
          b"img/up/x"]


class Base:
    """The base pack, its manifest's bytes, and each file entry's content by index."""

    def __init__(self, pack: Path, manifest: bytes, content: dict[int, bytes]) -> None:
        self.pack, self.manifest, self.content = pack, manifest, content

    def __repr__(self) -> str:  # short, in a falsifying example
        return f"Base({self.pack})"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Base:
    pack = tmp_path_factory.mktemp("base")
    write_base_pack(str(pack))
    m = Manifest(str(pack / MANIFEST_NAME))
    content = {m.lookup(p): data for p, data in FILES.items()}
    m.close()
    return Base(pack, (pack / MANIFEST_NAME).read_bytes(), content)


# -- mutations -------------------------------------------------------------------------------

ARRAYS = ["path_off", "hash", "parent", "kind", "mode", "mtime_ns", "size", "shard", "offset",
          "stored", "codec", "checksum", "first", "count", "slots", "strings"]
Mutation = tuple[Any, ...]


def _special(n: int) -> st.SearchStrategy[int]:
    return st.sampled_from([0, 1, 2, n - 1, n, n + 1, 63, 64, 65, 2**31, NO_INDEX, 2**32,
                            2**63, 2**64 - 1, 2**64 - 64])


mutation = st.one_of(
    st.tuples(st.just("array"), st.sampled_from(ARRAYS), st.integers(0, 10_000),
              st.one_of(_special(14), st.integers(0, 2**64 - 1))),
    st.tuples(st.just("byte"), st.integers(64, 10_000), st.integers(0, 255)),
    st.tuples(st.just("strings"), st.integers(0, 10_000), st.sampled_from(b"/.\0a\xff")),
    st.tuples(st.just("meta"), st.sampled_from(["entries", "pack_id", "shard_name", "shard_size",
                                                "array_off", "array_count", "array_dtype",
                                                "drop"]),
              st.integers(0, 20),
              st.one_of(_special(14), st.integers(-2, 2**70), st.sampled_from(
                  ["../x", "/etc/passwd", "", ".", "a/b", "<f8", ">u8", "O", "x.partial",
                   "shard-000001.sfs", None, [1], "zz"]))),
    st.tuples(st.just("shard"), st.integers(0, 1), st.integers(0, 2000), st.integers(0, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 1), st.integers(0, 2000)),
)


def _apply_meta(m: ManifestBytes, what: str, i: int, value: Any) -> None:
    meta = m.meta
    names = sorted(meta["arrays"])
    if what == "drop":
        meta.pop(sorted(meta)[i % len(meta)])
    elif what in ("shard_name", "shard_size"):
        meta["shards"][i % 2][0 if what == "shard_name" else 1] = value
    elif what.startswith("array_"):
        slot = {"array_dtype": 0, "array_off": 1, "array_count": 2}[what]
        meta["arrays"][names[i % len(names)]][slot] = value
    else:
        meta[what] = value


def mutate(pack: Path, manifest: bytes, mutations: list[Mutation]) -> None:
    m = ManifestBytes(manifest)
    # the metadata last: the other changes find the arrays where the metadata says they are
    for mut in sorted(mutations, key=lambda mut: mut[0] == "meta"):
        kind = mut[0]
        if kind == "array":
            arr = m.array(mut[1])
            arr = arr.view(f"<u{arr.itemsize}")  # any bit pattern, signed arrays too
            arr[mut[2] % len(arr)] = mut[3] % (1 << (8 * arr.itemsize))
        elif kind == "byte":
            m.buf[mut[1] % m.meta_off] = mut[2]
        elif kind == "strings":
            arr = m.array("strings")
            arr[mut[1] % len(arr)] = mut[2]
        elif kind == "meta":
            with contextlib.suppress(KeyError, TypeError, IndexError, AttributeError):
                _apply_meta(m, mut[1], mut[2], mut[3])  # an earlier change took its key away
        else:
            path = pack / shard_name(mut[1])
            data = bytearray(path.read_bytes())
            if not data:
                continue
            if kind == "shard":
                data[mut[2] % len(data)] = mut[3]
            else:
                del data[mut[2] % len(data):]
            path.write_bytes(bytes(data))
    (pack / MANIFEST_NAME).write_bytes(m.encode())


# -- the readers -----------------------------------------------------------------------------


def attempt(fn: Callable[[], Any]) -> Any:
    """``fn()``, or None if it raised a StagefsError (an allowed outcome): anything else
    propagates and fails the case."""
    try:
        return fn()
    except StagefsError as exc:
        assert str(exc), f"{type(exc).__name__} without a message"
        return None


def every_reader(pack: str, content: dict[int, bytes]) -> str:
    """Manifest, Namespace, Store, verify and the CLI over ``pack``; raises on a wrong
    outcome, else says how far the pack got (for the statistics of the run)."""
    opened = attempt(lambda: Manifest(os.path.join(pack, MANIFEST_NAME)).close() or True)
    reads = attempt(lambda: _store_readers(pack, content))
    report = attempt(lambda: verify_pack(pack, jobs=1, progress=False))
    for argv in (["ls", pack], ["ls", "-l", pack, "img"], ["stat", pack, "a.txt"],
                 ["stat", pack, "img/up"], ["cat", pack, "a.txt", "img/up"]):
        out, err = io.TextIOWrapper(io.BytesIO()), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
        assert code == 0 or (code == 1 and err.getvalue().startswith("stagefs: error: ")), (
            argv, code, err.getvalue())
    if not opened:
        return "manifest refused"
    return f"manifest opened; {reads} files read; verify {'ok' if report and report.ok else 'not ok'}"


def _store_readers(pack: str, content: dict[int, bytes]) -> int:
    read = 0
    with stagefs.open(pack) as fs:
        ns = fs.namespace
        for p in PROBES:
            for op in (ns.stat, ns.lstat, ns.listdir, ns.readlink, ns.exists, ns.isdir,
                       ns.islink, fs.getsize):
                attempt(lambda op=op, p=p: op(p))
            list(ns.walk(p))
            data = attempt(lambda p=p: fs.read(p))
            if data is not None:  # the bytes of the entry the path names, verified
                assert data == content.get(ns.entry(p)), p
                read += 1
            f = attempt(lambda p=p: fs.open(p))
            if f is not None:
                with f:
                    f.seek(3)
                    attempt(lambda f=f: f.read(100))
        files = [p for p in FILES]
        many = attempt(lambda: fs.read_many(files))
        if many is not None:
            assert [content.get(ns.entry(p)) for p in files] == list(many)
    return read


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "120")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(mutations=st.lists(mutation, min_size=1, max_size=3), speedups=st.booleans())
def test_mutated_packs_never_hang_or_crash(base: Base, mutations: list[Mutation],
                                           speedups: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        pack = Path(tmp) / "pack"
        shutil.copytree(base.pack, pack)
        mutate(pack, base.manifest, mutations)

        def case() -> str:
            os.environ["STAGEFS_SPEEDUPS"] = "1" if speedups else "0"
            os.environ["STAGEFS_RUNTIME"] = os.path.join(tmp, "runtime")
            os.environ.pop("STAGEFS_TIERS", None)
            return every_reader(str(pack), base.content)

        out = run_bounded(case, LIMIT)
        assert out.error is None and not out.hung, f"{mutations}: {out}"
        event(out.value)
