"""The differential probe of the front ends: one script, run on the real directory (the
oracle) and on the same tree served by a front end; the two results must be equal.

``probe(root)`` walks, stats, lists, reads, seeks and reads lines over the tree at ``root``
with the functions Python programs use, and returns a JSON-able record in which every path
is relative to ``root``. ``python frontend_probe.py ROOT`` prints it as JSON.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import stat as st
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _err(exc: BaseException) -> list[Any]:
    """The builtin exception type (what ``except`` clauses name) and the errno."""
    kind = next(c for c in type(exc).__mro__ if c.__module__ == "builtins")
    return ["error", kind.__name__, getattr(exc, "errno", None)]


def _try(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except OSError as exc:
        return _err(exc)


def _stat_rec(s: os.stat_result) -> list[Any]:
    kind = ("dir" if st.S_ISDIR(s.st_mode) else "link" if st.S_ISLNK(s.st_mode)
            else "file" if st.S_ISREG(s.st_mode) else "other")
    size = None if kind == "dir" else s.st_size
    return [kind, oct(s.st_mode), size, s.st_mtime_ns]


def _digest(b: bytes) -> str:
    return hashlib.sha1(b).hexdigest()


def _read_checks(full: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with open(full, "rb") as f:
        out["all"] = _digest(f.read())
        size = f.tell()
        f.seek(size // 2)
        out["mid"] = _digest(f.read(1000))
        f.seek(-min(size, 77), os.SEEK_END)
        out["tail"] = _digest(f.read())
        f.seek(3)
        out["pos"] = [f.tell(), _digest(f.read(10)), f.tell()]
        f.seek(0)
        chunks = []
        while c := f.read(65536 + 17):
            chunks.append(c)
        out["chunked"] = _digest(b"".join(chunks))
    if size <= 1 << 20:
        with open(full, encoding="utf-8", errors="replace") as t:
            lines = t.readlines()
        out["lines"] = [len(lines), _digest("".join(lines).encode("utf-8", "surrogatepass"))]
        with open(full, "rb") as f:
            out["first_line"] = _digest(f.readline())
    out["pathlib"] = _digest(Path(full).read_bytes())
    return out


def probe(root: str) -> dict[str, Any]:
    root = os.path.abspath(root)
    cut = len(root) + 1

    def rel(p: str) -> str:
        return p[cut:] if p != root else ""

    res: dict[str, Any] = {}
    walks = {}
    for follow in (False, True):
        walks[str(follow)] = sorted(
            [rel(d), sorted(ds), sorted(fs)] for d, ds, fs in os.walk(root, followlinks=follow))
    res["walk"] = walks
    res["walk_bottomup"] = [rel(d) for d, _, _ in os.walk(root, topdown=False)][-1:]
    paths = sorted({rel(os.path.join(d, n)) for d, ds, fs in os.walk(root)
                    for n in ds + fs} | {""})
    per: dict[str, Any] = {}
    for p in paths:
        full = os.path.join(root, p) if p else root
        r: dict[str, Any] = {
            "lstat": _try(lambda full=full: _stat_rec(os.lstat(full))),
            "stat": _try(lambda full=full: _stat_rec(os.stat(full))),
            "exists": os.path.exists(full), "lexists": os.path.lexists(full),
            "isfile": os.path.isfile(full), "isdir": os.path.isdir(full),
            "islink": os.path.islink(full),
            "getsize": _try(lambda full=full: os.path.getsize(full))
            if os.path.isfile(full) else None,
            "getmtime": _try(lambda full=full: os.path.getmtime(full)),
            "access_r": os.access(full, os.R_OK),
            "p_exists": Path(full).exists(), "p_is_file": Path(full).is_file(),
            "p_is_dir": Path(full).is_dir(),
        }
        if os.path.islink(full):
            r["readlink"] = os.readlink(full)
        if os.path.isdir(full):
            r["listdir"] = sorted(os.listdir(full))
            with os.scandir(full) as it:
                r["scandir"] = sorted(
                    [e.name, rel(e.path), e.is_dir(), e.is_file(), e.is_symlink(),
                     _try(lambda e=e: _stat_rec(e.stat(follow_symlinks=False)))]
                    for e in it)
            r["iterdir"] = sorted(rel(str(c)) for c in Path(full).iterdir())
            r["glob"] = sorted(rel(g) for g in glob.glob(os.path.join(glob.escape(full), "*")))
        elif os.path.isfile(full):
            r["read"] = _try(lambda full=full: _read_checks(full))
        per[p] = r
    res["paths"] = per
    res["rglob_txt"] = sorted(rel(str(p)) for p in Path(root).rglob("*.txt"))
    res["pglob"] = sorted(rel(str(p)) for p in Path(root).glob("*/*"))
    res["glob_rec"] = sorted(rel(g) for g in glob.glob(os.path.join(root, "**"), recursive=True))
    res["iglob"] = sorted(rel(g) for g in glob.iglob(os.path.join(root, "*", "*.jpg")))
    a_file = next(p for p in paths if os.path.isfile(os.path.join(root, p))
                  and not os.path.islink(os.path.join(root, p)))
    a_dir = next(p for p in paths if p and os.path.isdir(os.path.join(root, p)))
    j = os.path.join
    res["errors"] = {
        "open_missing": _try(lambda: open(j(root, "no/such/file"), "rb").close()),
        "open_dir": _try(lambda: open(j(root, a_dir), "rb").close()),
        "open_root": _try(lambda: open(root, "rb").close()),
        "open_under_file": _try(lambda: open(j(root, a_file, "x"), "rb").close()),
        "stat_missing": _try(lambda: os.stat(j(root, "missing"))),
        "stat_under_file": _try(lambda: os.stat(j(root, a_file, "x"))),
        "listdir_file": _try(lambda: os.listdir(j(root, a_file))),
        "listdir_missing": _try(lambda: os.listdir(j(root, "missing"))),
        "scandir_file": _try(lambda: list(os.scandir(j(root, a_file)))),
        "readlink_file": _try(lambda: os.readlink(j(root, a_file))),
        "getsize_missing": _try(lambda: os.path.getsize(j(root, "missing"))),
        "exists_missing": os.path.exists(j(root, "missing")),
        "dotdot": _try(lambda: _stat_rec(os.stat(j(root, a_dir, "..", a_file)))),
        "pathlib_missing": _try(lambda: Path(root, "missing").read_bytes()),
    }
    return res


if __name__ == "__main__":
    json.dump(probe(sys.argv[1]), sys.stdout, sort_keys=True)


def build_tree(root: Path) -> Path:
    """The sample tree of the suite plus unusual names and files of 0 bytes to a few MB."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from conftest import BASE_NS, build_sample_tree, random_bytes, set_mtime, text_bytes

    build_sample_tree(root)
    extra = {
        "names/ünïcödé.txt": text_bytes(3000, 7),
        "names/.hidden": b"hidden\n",
        "names/tab\tand space.txt": b"a\tb\n",
        "names/quote'\"[x].txt": b"q\n",
        "names/a" * 1 + "b" * 200: b"long\n",
        "sizes/one": b"x",
        "sizes/page": random_bytes(4096, 8),
        "sizes/odd": random_bytes(65537, 9),
        "sizes/three_mb.bin": random_bytes(3 * 2**20 + 5, 10),
        "sizes/five_mb.bin": random_bytes(5 * 2**20 + 3, 11),
        "sizes/lines.txt": text_bytes(900_000, 12),
        "sizes/empty2": b"",
        "deep/a/b/c/d/e/f.txt": b"deep file\nsecond line\n",
    }
    for i, (relp, data) in enumerate(sorted(extra.items())):
        p = root / relp
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        set_mtime(p, BASE_NS + 7 * 10**9 + i * 1_000_003)
    os.symlink("../sizes/five_mb.bin", root / "names/link_big")
    os.symlink("deep/a/b", root / "link_deep")
    for d in sorted((p for p in root.rglob("*") if p.is_dir() and not p.is_symlink()),
                    key=lambda p: -len(p.parts)):
        set_mtime(d, BASE_NS + 2 * 10**12)
    set_mtime(root, BASE_NS + 3 * 10**12)
    return root
