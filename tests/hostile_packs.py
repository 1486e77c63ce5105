"""Crafted packs: a small deterministic pack, and the hostile manifests made from it.

Each case changes the manifest as an attacker would (an array value, the names, the JSON
metadata) and then recomputes the body checksum, so the change gets past it. The cases are
checked into tests/data/hostile/<case>/ (manifest.sfm and the shards); this module is how
they were made, and the fuzz test (tests/unit/test_hostile_fuzz.py) uses its pieces::

    PYTHONPATH=src python3 tests/hostile_packs.py tests/data/hostile
"""

from __future__ import annotations

import json
import os
import pickle
import select
import shutil
import signal
import stat as st
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from xxhash import xxh3_64_intdigest

from stagefs.format import KIND_DIR, KIND_FILE, KIND_SYMLINK, MANIFEST_NAME, NO_INDEX
from stagefs.format.codecs import compress_auto
from stagefs.format.manifest import Entry, ManifestBuilder, ShardInfo
from stagefs.format.shard import ShardWriter, shard_name
from stagefs.format.spec import MANIFEST_HEADER

PACK_ID = bytes(range(16))
MTIME = 1_600_000_000_000_000_000

# path -> content of every regular file of the base pack (names differ by more than one byte,
# so a single flipped byte never turns one path into another)
FILES: dict[bytes, bytes] = {
    b"a.txt": b"stagefs shard manifest epoch sample tier node\n" * 40,
    b"ab/f1.txt": b"first file in ab\n",
    b"img/cat.jpg": b"\xff\xd8\xff\xe0" + bytes(range(256)) * 3,
    b"img/dog.jpg": b"\xff\xd8\xff\xe0" + bytes(range(255, -1, -1)) * 2,
    b"deep/er/most.bin": bytes(i * 7 % 251 for i in range(900)),
}
DIRS = [b"ab", b"img", b"deep", b"deep/er", b"empty"]
LINKS: dict[bytes, tuple[bytes, bytes | None]] = {  # path -> (target, resolved path)
    b"link": (b"a.txt", b"a.txt"),
    b"dangling": (b"nowhere", None),
    b"img/up": (b"../ab/f1.txt", b"ab/f1.txt"),
}
SHARD_FILES = [[b"a.txt", b"ab/f1.txt", b"deep/er/most.bin"], [b"img/cat.jpg", b"img/dog.jpg"]]


def write_base_pack(dest: str) -> None:
    """The pack every case starts from: two shards, zstd and raw files, links, an empty dir."""
    os.makedirs(dest, exist_ok=True)
    b = ManifestBuilder(PACK_ID)
    b.add(Entry(b"", KIND_DIR, st.S_IFDIR | 0o755, MTIME))
    for d in DIRS:
        b.add(Entry(d, KIND_DIR, st.S_IFDIR | 0o755, MTIME))
    for index, paths in enumerate(SHARD_FILES):
        w = ShardWriter(os.path.join(dest, shard_name(index)), index, PACK_ID)
        for p in paths:
            data = FILES[p]
            codec, stored = compress_auto(data, "auto")
            off = w.append(stored)
            b.add(Entry(p, KIND_FILE, st.S_IFREG | 0o644, MTIME, size=len(data), shard=index,
                        offset=off, stored=len(stored), codec=int(codec),
                        checksum=xxh3_64_intdigest(data)))
        w.close()
        b.shards.append(ShardInfo(shard_name(index), w.position))
    for p, (target, resolved) in LINKS.items():
        b.add(Entry(p, KIND_SYMLINK, st.S_IFLNK | 0o777, MTIME, link_target=target,
                    link_resolved=resolved))
    b.write(os.path.join(dest, MANIFEST_NAME))


class ManifestBytes:
    """A manifest as bytes that can be changed in place: its arrays as writable numpy
    views, its JSON metadata as a dict; ``encode()`` recomputes the body checksum."""

    def __init__(self, data: bytes) -> None:
        self.buf = bytearray(data)
        _, _, _, self.meta_off, meta_len, _, _ = MANIFEST_HEADER.unpack_from(self.buf)
        self.meta: dict[str, Any] = json.loads(bytes(self.buf[self.meta_off:][:meta_len]))
        self.meta_raw: bytes | None = None  # set to write these bytes as the metadata

    def array(self, name: str) -> npt.NDArray[Any]:
        dtype, off, count = self.meta["arrays"][name]
        return np.frombuffer(self.buf, dtype=np.dtype(dtype), count=count, offset=off)

    @property
    def n(self) -> int:
        return int(self.meta["entries"])

    def index(self, path: bytes) -> int:
        off, strings = self.array("path_off"), self.array("strings").tobytes()
        for i in range(self.n):
            if strings[off[i]:off[i + 1]] == path:
                return i
        raise KeyError(path)

    def encode(self) -> bytes:
        meta = self.meta_raw if self.meta_raw is not None else json.dumps(
            self.meta, sort_keys=True).encode()
        body = self.buf[:self.meta_off] + meta
        total = len(body)
        body_sum = xxh3_64_intdigest(memoryview(body)[MANIFEST_HEADER.size:])
        magic, version, flags, _, _, _, _ = MANIFEST_HEADER.unpack_from(self.buf)
        body[:MANIFEST_HEADER.size] = MANIFEST_HEADER.pack(
            magic, version, flags, self.meta_off, len(meta), total, body_sum)
        return bytes(body)


# -- running a reader that may never return ----------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """How ``run_bounded`` saw ``fn`` end: ``value``, an exception, or a hang."""

    value: Any = None
    error: str | None = None  # the exception's type name
    message: str = ""
    trace: str = ""
    hung: bool = False

    def __str__(self) -> str:
        if self.hung:
            return "still running at the time limit (a hang)"
        return self.trace or f"returned {self.value!r}"


def run_bounded(fn: Callable[[], Any], limit: float) -> Outcome:
    """Run ``fn`` in a forked child and say how it ended; a child still running after
    ``limit`` seconds is killed and reported as hung. A fork, not a thread or an alarm: a
    loop in C code never returns to the interpreter to see a signal."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the test runner
        os.close(r)
        try:
            out = Outcome(value=fn())
        except BaseException as exc:
            out = Outcome(error=type(exc).__name__, message=str(exc),
                          trace="".join(traceback.format_exception(exc)))
        try:
            data = pickle.dumps(out)
        except Exception as exc:  # a value that does not pickle
            data = pickle.dumps(Outcome(error="PicklingError", message=str(exc)))
        with os.fdopen(w, "wb") as f:
            f.write(data)
        os._exit(0)
    os.close(w)
    chunks = []
    deadline = time.monotonic() + limit
    try:
        while True:
            ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.kill(pid, signal.SIGKILL)
                return Outcome(hung=True)
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    if not chunks:
        return Outcome(error="died", message="the child died without a word")
    out: Outcome = pickle.loads(b"".join(chunks))
    return out


# -- the cases: what each changes, and a fragment of the message the reader must give ---------

Mutation = Callable[[ManifestBytes], None]


def _full_hash_table(m: ManifestBytes) -> None:
    slots = m.array("slots")
    slots[slots == 0] = 1  # every slot taken: a lookup of a missing path never ends


def _parent_cycle(m: ManifestBytes) -> None:
    a, b = m.index(b"deep"), m.index(b"deep/er")
    parent = m.array("parent")
    parent[a], parent[b] = b, a


def _child_range_past_end(m: ManifestBytes) -> None:
    m.array("count")[m.index(b"img")] = m.n + 5


def _shard_id_out_of_range(m: ManifestBytes) -> None:
    m.array("shard")[m.index(b"img/cat.jpg")] = 7


def _offset_past_shard_end(m: ManifestBytes) -> None:
    m.array("offset")[m.index(b"img/dog.jpg")] = m.meta["shards"][1][1] + 100


def _offset_wraps(m: ManifestBytes) -> None:
    m.array("offset")[m.index(b"img/dog.jpg")] = 2**64 - 16  # offset + stored wraps around 0


def _rename(old: bytes, new: bytes) -> Mutation:
    def mutate(m: ManifestBytes) -> None:
        assert len(old) == len(new)
        i = m.index(old)
        off, strings = m.array("path_off"), m.array("strings")
        strings[off[i]:off[i + 1]] = np.frombuffer(new, dtype="u1")
    return mutate


def _shard_name(name: str) -> Mutation:
    def mutate(m: ManifestBytes) -> None:
        m.meta["shards"][0][0] = name
    return mutate


def _symlink_target_out_of_blob(m: ManifestBytes) -> None:
    m.array("offset")[m.index(b"link")] = len(m.array("strings")) + 1000


def _symlink_resolves_past_end(m: ManifestBytes) -> None:
    m.array("first")[m.index(b"link")] = m.n + 3


def _slot_past_end(m: ManifestBytes) -> None:
    slots = m.array("slots")
    slots[int(np.flatnonzero(slots)[0])] = m.n + 9


def _huge_count(m: ManifestBytes) -> None:
    m.meta["arrays"]["kind"][2] = 2**70


def _huge_entries(m: ManifestBytes) -> None:
    m.meta["entries"] = 2**64 + 1


def _kind(value: int) -> Mutation:
    def mutate(m: ManifestBytes) -> None:
        m.array("kind")[m.index(b"a.txt")] = value
    return mutate


def _unknown_codec(m: ManifestBytes) -> None:
    m.array("codec")[m.index(b"a.txt")] = 9


def _wrong_dtype(m: ManifestBytes) -> None:
    m.meta["arrays"]["parent"][0] = "<f4"


def _deep_json(m: ManifestBytes) -> None:
    meta = json.dumps(m.meta, sort_keys=True).encode()
    m.meta_raw = meta[:-1] + b', "source": ' + b"[" * 5_000 + b"]" * 5_000 + b"}"


def _zstd_size_too_large(m: ManifestBytes) -> None:
    m.array("size")[m.index(b"a.txt")] = 2**62  # decoding would allocate it


def _root_not_dir(m: ManifestBytes) -> None:
    m.array("kind")[0] = KIND_FILE


def _dir_has_shard(m: ManifestBytes) -> None:
    m.array("shard")[m.index(b"img")] = 0


def _child_of_wrong_parent(m: ManifestBytes) -> None:
    m.array("parent")[m.index(b"img/cat.jpg")] = m.index(b"ab")


def _first_child_past_end(m: ManifestBytes) -> None:
    m.array("first")[m.index(b"ab")] = NO_INDEX - 1


def _path_off_backwards(m: ManifestBytes) -> None:
    off = m.array("path_off")
    off[3] = off[5] + 1


CASES: dict[str, tuple[Mutation, str]] = {
    "full_hash_table": (_full_hash_table, "no empty slot"),
    "slot_past_end": (_slot_past_end, "hash table"),
    "parent_cycle": (_parent_cycle, "parent"),
    "child_of_wrong_parent": (_child_of_wrong_parent, "children"),
    "child_range_past_end": (_child_range_past_end, "children"),
    "first_child_past_end": (_first_child_past_end, "children"),
    "root_not_a_directory": (_root_not_dir, "root"),
    "shard_id_out_of_range": (_shard_id_out_of_range, "shard"),
    "directory_with_shard": (_dir_has_shard, "shard"),
    "offset_past_shard_end": (_offset_past_shard_end, "past the end of shard"),
    "offset_wraps": (_offset_wraps, "past the end of shard"),
    "name_with_slash": (_rename(b"a.txt", b"a/txt"), "path"),
    "name_dotdot": (_rename(b"ab", b".."), "'..'"),
    "name_dot": (_rename(b"ab/f1.txt", b"ab/./.txt"), "'.'"),
    "name_empty": (_rename(b"img/up", b"img//p"), "empty"),
    "name_nul": (_rename(b"a.txt", b"a\0txt"), "NUL"),
    "path_off_backwards": (_path_off_backwards, "path"),
    "shard_name_dotdot": (_shard_name("../x"), "shard name"),
    "shard_name_absolute": (_shard_name("/etc/passwd"), "shard name"),
    "shard_name_partial": (_shard_name("shard-000001.sfs.partial"), "shard name"),
    "shard_name_duplicate": (_shard_name("shard-000001.sfs"), "shard name"),
    "symlink_target_out_of_blob": (_symlink_target_out_of_blob, "symlink"),
    "symlink_resolves_past_end": (_symlink_resolves_past_end, "symlink"),
    "huge_count": (_huge_count, "array"),
    "huge_entries": (_huge_entries, "entries"),
    "wrong_dtype": (_wrong_dtype, "dtype"),
    "deep_json": (_deep_json, "metadata"),
    "unknown_kind": (_kind(7), "kind"),
    "unknown_codec": (_unknown_codec, "codec"),
    "zstd_size_too_large": (_zstd_size_too_large, "size"),
}


def write_case(dest: str, mutate: Mutation, base: str) -> None:
    """``base`` (a pack) copied to ``dest`` with its manifest changed by ``mutate``."""
    os.makedirs(dest, exist_ok=True)
    for name in sorted(os.listdir(base)):
        if name != MANIFEST_NAME:
            shutil.copyfile(os.path.join(base, name), os.path.join(dest, name))
    with open(os.path.join(base, MANIFEST_NAME), "rb") as f:
        m = ManifestBytes(f.read())
    mutate(m)
    with open(os.path.join(dest, MANIFEST_NAME), "wb") as f:
        f.write(m.encode())


def write_corpus(root: str) -> None:
    base = os.path.join(root, "_base")
    shutil.rmtree(root, ignore_errors=True)
    write_base_pack(base)
    for name, (mutate, _) in CASES.items():
        write_case(os.path.join(root, name), mutate, base)
    shutil.rmtree(base)


if __name__ == "__main__":
    write_corpus(sys.argv[1])
