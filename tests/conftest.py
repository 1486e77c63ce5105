"""Shared fixtures: sample source trees, packs of them, and a tree walker to compare trees.

Each helper has a clearly named function so other suites can import or extend them; the
fixtures of the foundation suite are prefixed ``sample_``.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import stat as st
import subprocess
import tempfile
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import stagefs

# The suite is a job of its own: what it runs without naming a runtime (the CLI in a
# subprocess, a store with tiers) uses <base>/tests-<pid>, removed at the end, not the
# runtime of the shell that ran pytest, where `stagefs status` would show the tests' tiers
# and reads long after. Tests of job identity give their processes an environment of
# their own.
_SUITE_JOB = f"tests-{os.getpid()}"
os.environ["STAGEFS_JOB"] = _SUITE_JOB


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from stagefs.runtime import Runtime

    if os.environ.get("STAGEFS_JOB") == _SUITE_JOB and not os.environ.get("STAGEFS_RUNTIME"):
        shutil.rmtree(Runtime().path, ignore_errors=True)


# A JPEG-looking file: the magic bytes, then incompressible noise.
JPEG_MAGIC = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00"


def random_bytes(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def held_open(under: str | os.PathLike[str]) -> list[str]:
    """The files under ``under`` (a path, or a path's start) that this process holds open,
    one entry a descriptor (a mapping holds one of its own); a deleted one ends with
    " (deleted)"."""
    prefix = os.fspath(under)
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(prefix):
            out.append(target)
    return out


def held_deleted(under: str | os.PathLike[str]) -> list[str]:
    """The files under ``under`` that this process holds open and that are deleted: their
    blocks stay allocated while it lives."""
    return [t for t in held_open(under) if t.endswith(" (deleted)")]


def flip_byte(path: str | os.PathLike[str], offset: int, mask: int = 0xFF) -> None:
    """Corrupt one byte of a file in place (a bad tier copy, shard or manifest)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def text_bytes(n: int, seed: int = 0) -> bytes:
    """Compressible text of exactly ``n`` bytes."""
    rng = random.Random(seed)
    words = [b"stagefs", b"shard", b"manifest", b"epoch", b"sample", b"tier", b"node"]
    out = bytearray()
    while len(out) < n:
        out += rng.choice(words) + (b"\n" if rng.random() < 0.1 else b" ")
    return bytes(out[:n])


def npy_bytes(n_items: int) -> bytes:
    """A .npy file of a smooth float32 array (compresses well)."""
    import io

    import numpy as np

    buf = io.BytesIO()
    np.save(buf, (np.arange(n_items, dtype=np.float32) % 97))
    return buf.getvalue()


def jpeg_bytes(n: int, seed: int = 0) -> bytes:
    return (JPEG_MAGIC + random_bytes(n, seed))[:n]


def set_mtime(path: Path | str, ns: int) -> None:
    os.utime(path, ns=(ns, ns), follow_symlinks=False)


BASE_NS = 1_600_000_000_123_456_789


def build_sample_tree(root: Path) -> Path:
    """A tree with every kind of entry the packer accepts by default.

    Layout (``root`` is created)::

        a.txt                text, compressible
        empty.bin            0 bytes
        img/cat.jpg          JPEG magic + noise
        img/dog.jpg
        data/arr.npy         numpy array
        data/rand.bin        200 KB random
        data/nested/deep/x   small file, mode 0600
        emptydir/            empty directory, mode 0700
        "we ird name.txt"    a name with a space
        -dash                a leading dash
        link_file -> a.txt
        link_dir -> img
        link_chain -> link_file
        link_dangling -> nowhere
        img/up -> ../data/arr.npy
        exec.sh              mode 0755
    """
    root.mkdir(parents=True, exist_ok=True)
    files: dict[str, bytes] = {
        "a.txt": text_bytes(5000, 1),
        "empty.bin": b"",
        "img/cat.jpg": jpeg_bytes(30_000, 2),
        "img/dog.jpg": jpeg_bytes(12_345, 3),
        "data/arr.npy": npy_bytes(10_000),
        "data/rand.bin": random_bytes(200_000, 4),
        "data/nested/deep/x": b"deep\n",
        "we ird name.txt": b"spaces\n",
        "-dash": b"dash\n",
        "exec.sh": b"#!/bin/sh\necho hi\n",
    }
    (root / "emptydir").mkdir()
    for i, (rel, data) in enumerate(sorted(files.items())):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        set_mtime(p, BASE_NS + i * 1_000_000_007)
    os.chmod(root / "data/nested/deep/x", 0o600)
    os.chmod(root / "exec.sh", 0o755)
    os.chmod(root / "emptydir", 0o700)
    links = {
        "link_file": "a.txt",
        "link_dir": "img",
        "link_chain": "link_file",
        "link_dangling": "nowhere",
        "img/up": "../data/arr.npy",
    }
    for i, (rel, target) in enumerate(sorted(links.items())):
        os.symlink(target, root / rel)
        set_mtime(root / rel, BASE_NS - i * 999)
    # directories last, deepest first: creating entries changes a directory's mtime
    dirs = sorted((p for p in root.rglob("*") if p.is_dir() and not p.is_symlink()),
                  key=lambda p: -len(p.parts))
    for i, d in enumerate([*dirs, root]):
        set_mtime(d, BASE_NS + 10**12 + i * 13)
    return root


@dataclass(frozen=True)
class Node:
    """What a tree walker sees at one path (compared with ``==``)."""

    kind: str  # "file", "dir", "link"
    mode: int
    mtime_ns: int
    content: bytes  # file bytes, or a symlink's target


def pack_files(base: Path, name: str, files: dict[str, bytes]) -> Path:
    """Write ``files`` (relative path -> bytes) under ``base/name`` and pack them into
    ``base/name.pack`` (8 MiB shards; packed again over an earlier pack of that name)."""
    for rel, data in files.items():
        p = base / name / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    out = base / f"{name}.pack"
    stagefs.pack(base / name, out, shard_size="8MiB", jobs=1, progress=False,
                 echo=lambda _m: None, overwrite=out.exists())
    return out


def snapshot_tree(root: Path | str | bytes, *, mtimes: bool = True) -> dict[bytes, Node]:
    """Every path under ``root`` (bytes, relative), with kind, mode, mtime and content.

    Directory mtimes are included too; pass ``mtimes=False`` to leave all mtimes out.
    """
    top = os.fsencode(root)
    out: dict[bytes, Node] = {}
    stack = [b""]
    while stack:
        rel = stack.pop()
        full = os.path.join(top, rel) if rel else top
        s = os.lstat(full)
        ns = s.st_mtime_ns if mtimes else 0
        if st.S_ISLNK(s.st_mode):
            out[rel] = Node("link", s.st_mode, ns, os.readlink(full))
        elif st.S_ISDIR(s.st_mode):
            out[rel] = Node("dir", s.st_mode, ns, b"")
            stack += [os.path.join(rel, n) if rel else n for n in os.listdir(full)]
        else:
            with open(full, "rb") as f:
                out[rel] = Node("file", s.st_mode, ns, f.read())
    return out


@pytest.fixture
def sample_tree(tmp_path: Path) -> Path:
    """A fresh copy of ``build_sample_tree`` for one test."""
    return build_sample_tree(tmp_path / "src")


@pytest.fixture(scope="session")
def sample_pack_session(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(source tree, pack) built once per session; tests must not modify either."""
    base = tmp_path_factory.mktemp("sample")
    src = build_sample_tree(base / "src")
    dest = base / "pack"
    stagefs.pack(src, dest, shard_size="64KiB", jobs=1, progress=False, echo=lambda _m: None)
    return src, dest


@pytest.fixture
def sample_store(sample_pack_session: tuple[Path, Path]) -> Iterator[stagefs.Store]:
    with stagefs.open(sample_pack_session[1]) as fs:
        yield fs


@pytest.fixture
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A runtime dir of the test's own ($STAGEFS_RUNTIME), and no tiers from the caller's
    environment."""
    rt = tmp_path / "runtime"
    monkeypatch.setenv("STAGEFS_RUNTIME", str(rt))
    monkeypatch.delenv("STAGEFS_TIERS", raising=False)
    return rt


@pytest.fixture
def memory_dir(runtime: Path) -> Iterator[Path]:
    """A directory on /dev/shm for a memory tier (removed after the test)."""
    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm on this machine")
    d = Path("/dev/shm") / f"stagefs-test-{uuid.uuid4().hex[:8]}"
    yield d
    shutil.rmtree(d, ignore_errors=True)


def reseal_manifest(raw: bytearray) -> bytes:
    """A manifest's bytes with its body checksum made right again (a crafted manifest, as
    an attacker who can write the pack would make it)."""
    from xxhash import xxh3_64_intdigest

    from stagefs.format.spec import MANIFEST_HEADER

    raw[40:48] = xxh3_64_intdigest(bytes(raw[MANIFEST_HEADER.size :])).to_bytes(8, "little")
    return bytes(raw)


def patch_manifest(path: Path, old: bytes, new: bytes) -> None:
    """Replace bytes in the manifest's string blob and re-seal its checksum."""
    from stagefs.format.spec import MANIFEST_HEADER

    raw = bytearray(path.read_bytes())
    at = raw.index(old, MANIFEST_HEADER.size)
    raw[at : at + len(old)] = new
    path.write_bytes(reseal_manifest(raw))


def as_nobody(fn: Callable[[], object]) -> tuple[int, str]:
    """Run ``fn`` in a forked child as uid/gid 65534 (when root; else as this user), to see
    what a user without root sees.

    Returns (0, "") if it returned, (1, message) for a StagefsError, (2, repr) for anything
    else (a traceback the user would have seen)."""
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
        pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 3
        try:
            os.close(r)
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
            fn()
            code = 0
        except stagefs.StagefsError as exc:
            os.write(w, f"{type(exc).__name__}: {exc}".encode())
            code = 1
        except BaseException as exc:
            os.write(w, repr(exc).encode())
            code = 2
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        msg = f.read().decode()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), msg


@contextlib.contextmanager
def world_dir() -> Iterator[Path]:
    """A directory others can enter (pytest's tmp dirs are private to root), for checks run
    as an unprivileged user (``as_nobody``); removed after, whatever modes a test left."""
    d = Path(tempfile.mkdtemp(prefix="stagefs-world-"))
    try:
        os.chmod(d, 0o755)
        yield d
    finally:
        for dirpath, _dirs, _files in os.walk(d):
            os.chmod(dirpath, 0o755)
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str, *options: str) -> Iterator[Path]:
    """A file system of ``size`` (a tmpfs, with mount ``options``) mounted at ``where``
    (made), unmounted after: a full tier, runtime or destination. The test is skipped only
    where this process cannot mount one (root is needed)."""
    if shutil.which("mount") is None:
        pytest.skip("no mount command here to make a small file system with")
    where.mkdir(parents=True, exist_ok=True)
    opts = ",".join((*options, f"size={size}"))
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)],
                       capture_output=True, text=True, timeout=30, check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a {size} tmpfs here (root is needed): {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], timeout=30, check=False)
