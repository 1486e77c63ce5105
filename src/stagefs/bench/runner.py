"""``stagefs bench``: the same dataset, converted for each system, read in shuffled epochs by
each, alternating systems within each round, medians over rounds.

Each (system, round) runs in its own worker process (worker.py): the first epoch after the
page cache was dropped (when root) and every node-local cache emptied, then warm epochs.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from stagefs.bench.base import Context, System, write_index
from stagefs.bench.systems import all_systems, serve_fuse, stop_fuse
from stagefs.config import format_size
from stagefs.errors import ConfigError

__all__ = ["BenchConfig", "run_bench"]

PEER_PYTHON_ENV = "STAGEFS_BENCH_PEER_PYTHON"


@dataclass
class BenchConfig:
    dataset: str = "imagenet-like"
    files: int = 2000
    origin: str | None = None
    epochs: int = 3
    runs: int = 3
    systems: Sequence[str] | None = None
    out: str = "bench-results"
    work: str | None = None  # conversions (default: next to the origin)
    local: str | None = None  # node-local scratch (default: /dev/shm or the temp dir)
    peer_python: str | None = None
    keep: bool = False
    drop_caches: bool = True  # drop the page cache before each cold epoch (when root)
    timeout: float = 3600.0
    command: str = ""
    log: Any = field(default=None, repr=False)

    def say(self, msg: str) -> None:
        """A line of progress: on stderr, as every command's (stdout is the results)."""
        stamp = time.strftime("%H:%M:%S")
        print(f"[{stamp}] {msg}", file=self.log or sys.stderr, flush=True)


def drop_caches() -> bool:
    """Drop the kernel's page cache (needs root); True if done."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
    except OSError:
        return False
    return True


def _dataset(cfg: BenchConfig) -> tuple[str, bool]:
    """The raw dataset's directory, and whether this run generated it.

    A generation that does not finish (an error, Ctrl-C) removes what it wrote: a later run
    would take the part written for the dataset."""
    from stagefs.bench.datasets import imagenet_like, npz_like

    if cfg.dataset not in ("imagenet-like", "npz"):
        raise ConfigError(f"--dataset {cfg.dataset!r}: use imagenet-like or npz")
    if cfg.origin:
        root = os.path.abspath(cfg.origin)
        if os.path.exists(root) and not os.path.isdir(root):
            raise ConfigError(f"--origin {cfg.origin}: a file, not a directory: name the "
                              "dataset's directory, or an empty or new one to generate it in")
        if os.path.isdir(root) and os.listdir(root):
            return root, False
        made = not os.path.exists(root)
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--origin {cfg.origin}: cannot create it ({exc.strerror}): "
                              "name a directory you can write") from None
    else:
        root, made = tempfile.mkdtemp(prefix="stagefs-bench-data-"), True
    cfg.say(f"generating {cfg.files:,} {cfg.dataset} files in {root}")
    try:
        if cfg.dataset == "imagenet-like":
            imagenet_like(root, files=cfg.files, classes=max(1, min(1000, cfg.files // 100)),
                          progress=False)
        else:
            npz_like(root, files=cfg.files, progress=False)
    except OSError as exc:  # a full or read-only origin: name it and what it needs
        _empty(root, remove=made)
        need = cfg.files * (110_000 if cfg.dataset == "imagenet-like" else 17_000)
        todo = (f"they need about {format_size(need)}: free space there, or name another "
                "directory with --origin" if exc.errno in (errno.ENOSPC, errno.EDQUOT)
                else "name a directory you can write with --origin")
        raise ConfigError(f"--origin {root}: generating {cfg.files:,} {cfg.dataset} files "
                          f"there failed ({exc.strerror or exc}): {todo}") from None
    except BaseException:
        _empty(root, remove=made)
        raise
    return root, True


def _empty(path: str, remove: bool) -> None:
    """Remove ``path`` (``remove``) or everything in it."""
    if remove:
        shutil.rmtree(path, ignore_errors=True)
        return
    for name in os.listdir(path):
        p = os.path.join(path, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(p)


def _claim(flag: str, path: str, prefix: str) -> str:
    """A directory of this run's own under ``path``: ``path`` itself when it does not exist
    yet (made here), else a new directory in it. Removing the result at the end then never
    removes what was there before (``--local /dev/shm`` must not empty /dev/shm)."""
    path = os.path.abspath(path)
    try:
        if not os.path.lexists(path):
            os.makedirs(path)
            return path
        if not os.path.isdir(path):
            raise ConfigError(f"{flag} {path}: not a directory: name a directory (it is "
                              "made if missing)")
        return tempfile.mkdtemp(prefix=prefix, dir=path)
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot make a directory there ({exc.strerror}): "
                          f"name a directory you can write with {flag}") from None


def check_out(out: str, what: str = "the report") -> None:
    """The directory ``what`` goes to (--out) can be made and written, else a ConfigError
    (checked before the run, not after it)."""
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise ConfigError(f"--out {out}: {what} cannot be written there ({exc.strerror}): "
                          "name a directory you can write with --out DIR") from None


def _peer_python(cfg: BenchConfig, systems: Sequence[System]) -> str:
    """The peers' Python, checked when a peer is to run: it must be there and executable."""
    given = cfg.peer_python or os.environ.get(PEER_PYTHON_ENV)
    if not given:
        return sys.executable
    if any(s.interpreter == "peers" for s in systems) and shutil.which(given) is None:
        source = "--peer-python" if cfg.peer_python else f"${PEER_PYTHON_ENV}"
        why = ("not an executable file" if os.path.exists(given) else "no such file")
        raise ConfigError(f"{source} {given}: {why}: give the Python that has the peers and "
                          "stagefs installed (docs/benchmarks.md, 'Reproduce it'), or leave the "
                          "peers out with --systems")
    return given


def _index(raw: str, path: str) -> tuple[int, int, list[str]]:
    """Index the regular files under ``raw`` (as ``stagefs pack`` packs them); (files,
    bytes, the other names: a FIFO, which a plain read would wait on forever, a socket, a
    device, a symlink to nothing)."""
    rows: list[tuple[str, int]] = []
    other: list[str] = []
    for d, dirs, files in os.walk(raw):
        dirs.sort()
        for name in files:
            full = os.path.join(d, name)
            try:
                info = os.stat(full)
            except FileNotFoundError:  # a symlink to nothing (or removed since listed)
                other.append(os.path.relpath(full, raw))
                continue
            if stat.S_ISREG(info.st_mode):
                rows.append((os.path.relpath(full, raw), info.st_size))
            else:
                other.append(os.path.relpath(full, raw))
    rows.sort()
    if not rows:
        raise ConfigError(f"{raw}: no files to read (give --origin a directory with files)")
    write_index(path, rows)
    return len(rows), sum(s for _, s in rows), sorted(other)


def _du(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for d, _, names in os.walk(path):
        for n in names:
            with contextlib.suppress(OSError):  # a symlink to nothing: no bytes
                total += os.path.getsize(os.path.join(d, n))
    return total


def _local_default() -> str:
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return tempfile.mkdtemp(prefix="stagefs-bench-", dir=shm)
    return tempfile.mkdtemp(prefix="stagefs-bench-local-")


class _Worker:
    """Runs worker.py for one system in the interpreter it needs."""

    def __init__(self, cfg: BenchConfig, ctx: Context, scratch: str,
                 peer_python: str | None = None) -> None:
        self.cfg, self.ctx, self.scratch = cfg, ctx, scratch
        self.peer_python = (peer_python or cfg.peer_python or os.environ.get(PEER_PYTHON_ENV)
                            or sys.executable)

    def python(self, system: System) -> str:
        return self.peer_python if system.interpreter == "peers" else sys.executable

    def call(self, system: System, op: str, **extra: Any) -> dict[str, Any]:
        spec = {"op": op, "system": system.name, "ctx": asdict(self.ctx), **extra}
        fd, spec_path = tempfile.mkstemp(suffix=".json", dir=self.scratch)
        with os.fdopen(fd, "w") as f:
            json.dump(spec, f)
        out_path = spec_path[:-5] + ".out.json"
        # the peers' libraries put caches and temporary files under the temp dir (LitData's
        # chunks/ and data/, torch's inductor cache): keep them in this run's scratch dir
        env = dict(os.environ, PYTHONWARNINGS="ignore", TMPDIR=self.scratch,
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(self.scratch, "torchinductor"))
        try:
            r = subprocess.run([self.python(system), "-m", "stagefs.bench.worker", spec_path,
                                out_path], env=env, capture_output=True, text=True,
                               timeout=self.cfg.timeout, check=False)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {self.cfg.timeout:.0f} s"}
        finally:
            os.unlink(spec_path)
        try:
            with open(out_path) as f:
                result: dict[str, Any] = json.load(f)
            os.unlink(out_path)
        except OSError:
            tail = (r.stderr or r.stdout).strip()[-1500:] or "no output"
            return {"error": f"worker exited {r.returncode}: {tail}"}
        return result


def _select(names: Sequence[str] | None) -> list[System]:
    systems = list(all_systems())
    if not names:
        return systems
    known = {s.name: s for s in systems}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"unknown system(s) {', '.join(unknown)}: choose from "
                          f"{', '.join(known)}")
    return [known[n] for n in dict.fromkeys(names)]  # each once: a run reads each once


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Run the whole benchmark; write JSON, table and plots to cfg.out; return the results."""
    from stagefs.bench.report import write_report

    if cfg.epochs < 1 or cfg.runs < 1 or cfg.files < 1:
        raise ConfigError("--epochs, --runs and --files must be at least 1")
    systems = _select(cfg.systems)
    peer_python = _peer_python(cfg, systems)  # before --out is made: a refusal leaves none
    made_out = not os.path.exists(cfg.out)
    check_out(cfg.out)
    raw, generated = "", False
    claimed: list[str] = []  # this run's own directories, removed at the end
    try:
        raw, generated = _dataset(cfg)
        conv = _claim("--work" if cfg.work else "--work (default: ORIGIN.bench)",
                      cfg.work or raw.rstrip("/") + ".bench", "stagefs-bench-conv-")
        claimed.append(conv)
        local = (_claim("--local", cfg.local, "stagefs-bench-") if cfg.local
                 else _local_default())
        claimed.append(local)
        if cfg.keep:
            cfg.say(f"conversions in {conv}, local copies in {local} (kept: --keep)")
        scratch = tempfile.mkdtemp(prefix="worker-", dir=local)
        ctx = Context(raw=raw, conv=conv, local=local,
                      index=os.path.join(scratch, "index.tsv"),
                      fuse_mount=os.path.join(local, "fuse-mount"))
        return _run(cfg, systems, ctx, scratch, raw, write_report, peer_python, generated)
    finally:
        if not cfg.keep:
            for d in claimed:
                shutil.rmtree(d, ignore_errors=True)
            if generated and not cfg.origin:
                shutil.rmtree(raw, ignore_errors=True)
        if made_out:  # made for a report that was not written (an error, Ctrl-C)
            with contextlib.suppress(OSError):
                os.rmdir(cfg.out)


def _run(cfg: BenchConfig, systems: list[System], ctx: Context, scratch: str, raw: str,
         write_report: Any, peer_python: str | None = None,
         generated: bool = True) -> dict[str, Any]:
    files, total, other = _index(raw, ctx.index)
    if other:
        cfg.say(f"left out {len(other):,} name(s) that are not regular files (a FIFO, a "
                f"socket, a device, a symlink to nothing), as stagefs pack does: "
                + ", ".join(other[:5]) + (", ..." if len(other) > 5 else ""))
    # a dataset found at --origin is what it is: --dataset and --files shape a generated
    # one only, and the report must not call 300 JPEG-like files "npz"
    kind = cfg.dataset if generated else "existing"
    cfg.say(f"dataset: {files:,} files, {total / 1e6:,.1f} MB in {raw}" + (
        "" if generated else " (found there: --dataset and --files apply to generating only)"))
    worker = _Worker(cfg, ctx, scratch, peer_python)
    results: dict[str, Any] = {
        "command": cfg.command, "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "dataset": {"kind": kind, "root": raw, "files": files, "bytes": total},
        "where": {"origin": raw, "conversions": ctx.conv, "local": ctx.local},
        "epochs": cfg.epochs, "runs": cfg.runs, "machine": _machine(),
        "systems": {}, "skipped": {}, "requested": list(cfg.systems or []),
    }
    active: list[System] = []
    conversions: dict[str, dict[str, Any]] = {}
    for s in systems:
        probe = worker.call(s, "probe")
        reason = probe.get("missing") or probe.get("error")
        if reason and s.interpreter == "peers":
            reason += (f" (in {worker.python(s)}: give --peer-python, or "
                       f"${PEER_PYTHON_ENV}, the Python that has it and stagefs installed)")
        if reason:
            cfg.say(f"  {s.name}: left out ({reason.splitlines()[0]})")
            results["skipped"][s.name] = reason
            continue
        key = getattr(s, "pack_name", s.name)
        if key not in conversions:
            cfg.say(f"converting for {s.name} ...")
            cold = cfg.drop_caches and drop_caches()  # each converter reads the raw data cold
            conversions[key] = c = worker.call(s, "convert")
            c["cold"] = cold
            if "error" not in c:
                c["bytes_on_disk"] = _du(c["dir"])
                cfg.say(f"  {c['seconds']:.1f} s, {c['bytes_on_disk'] / 1e6:,.1f} MB")
        c = conversions[key]
        if "error" in c:  # a failure, not an absence: a row of its own, and the exit status
            cfg.say(f"  {s.name}: conversion failed: {c['error']}")
            results["systems"][s.name] = {
                "title": s.title, "settings": s.settings, "on_origin": s.on_origin,
                "interpreter": worker.python(s), "conversion": {**c, "shared_with": key},
                "epochs": [], "errors": [f"conversion failed: {c['error']}"]}
            continue
        results["systems"][s.name] = {
            "title": s.title, "settings": s.settings, "on_origin": s.on_origin,
            "interpreter": worker.python(s), "conversion": {**c, "shared_with": key},
            "epochs": [], "errors": []}
        active.append(s)
    sizes_path = os.path.join(scratch, "sizes.json")
    _write_sizes(ctx, raw, sizes_path)
    roots = [raw, ctx.conv]
    dropped = cfg.drop_caches and drop_caches()
    results["cold"] = ("page cache dropped" if dropped else "page cache NOT dropped ("
                       + ("not root" if cfg.drop_caches else "--no-drop-caches") + ")")
    if not dropped:  # the terminal's table calls the first epochs cold: say what they are
        cfg.say(f"{results['cold']}: a first epoch may read from memory, not the origin"
                + (" (run as root to drop it before each cold epoch)" if cfg.drop_caches
                   else ""))
    results["order"] = [s.name for s in active]
    pack = conversions.get("stagefs")
    if pack is not None and "error" not in pack:
        results["origin_limit"] = []
    try:
        _runs(cfg, worker, active, ctx, results, pack, files, roots, sizes_path)
    except KeyboardInterrupt:  # the runs that ended are worth keeping: hours, on a real PFS
        if not any(s["epochs"] for s in results["systems"].values()):
            raise
        results["interrupted"] = (f"stopped by Ctrl-C during run {results['runs_started']} "
                                  f"of {cfg.runs}: medians of the epochs that ended")
        _finish(results, files, cfg.out, write_report)
        cfg.say(f"interrupted: the epochs that ended are reported in {cfg.out}")
        raise
    _finish(results, files, cfg.out, write_report)
    return results


def _finish(results: dict[str, Any], files: int, out: str, write_report: Any) -> None:
    results["load_average"] = {"start": results["machine"]["load_average"],
                               "end": list(os.getloadavg())}
    _check(results, files)
    write_report(results, out)


def _runs(cfg: BenchConfig, worker: _Worker, active: list[System], ctx: Context,
          results: dict[str, Any], pack: dict[str, Any] | None, files: int,
          roots: list[str], sizes_path: str) -> None:
    for run in range(cfg.runs):
        results["runs_started"] = run + 1
        if pack is not None and "origin_limit" in results:  # the link's sequential limit
            from stagefs.bench.limit import label, origin_limit

            # the kept pass writes where the tiers are: node-local scratch
            passes = origin_limit(pack["dir"], files, lambda: cfg.drop_caches and drop_caches(),
                                  keep=ctx.local)
            results["origin_limit"].extend({**p, "run": run} for p in passes)
            cfg.say("origin limit: " + ", ".join(
                f"{label(p)} {p['mb_per_s']:,.0f} MB/s ({p['samples_per_s']:,.0f} samples/s)"
                for p in passes))
        order = active[run % len(active):] + active[:run % len(active)] if active else []
        for s in order:
            cfg.say(f"run {run + 1}/{cfg.runs}: {s.name}")
            res = _one_run(cfg, worker, s, ctx, run, roots, sizes_path)
            entry = results["systems"][s.name]
            if "error" in res:
                cfg.say(f"  error: {res['error'].splitlines()[0][:300]}")
                entry["errors"].append(res["error"])
                continue
            entry["epochs"].extend(res["epochs"])
            cfg.say("  " + ", ".join(f"{e['samples_per_s']:,.0f}/s" for e in res["epochs"]))


def _one_run(cfg: BenchConfig, worker: _Worker, s: System, ctx: Context, run: int,
             roots: list[str], sizes_path: str) -> dict[str, Any]:
    server = None
    stats_file = os.path.join(worker.scratch, "fuse-origin-stats.json")
    try:
        if s.name == "stagefs-fuse":
            if os.path.exists(stats_file):
                os.unlink(stats_file)
            server = serve_fuse(ctx, stats_file)
        cold = cfg.drop_caches and drop_caches()
        return worker.call(s, "run", run=run, epochs=cfg.epochs, cold=cold,
                           origin_roots=roots, sizes=sizes_path,
                           server_pid=server.pid if server else None,
                           server_stats=stats_file if server else None)
    except (RuntimeError, OSError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        if server is not None:
            stop_fuse(ctx, server)
        if s.on_origin:  # its caches and tiers: a run starts empty anyway, free the memory
            shutil.rmtree(ctx.scratch(s.name), ignore_errors=True)


def _write_sizes(ctx: Context, raw: str, path: str) -> None:
    sizes: dict[str, int] = {}
    for top in (raw, ctx.conv):
        for d, _, names in os.walk(top):
            for n in names:
                p = os.path.join(d, n)
                try:
                    sizes[os.path.normpath(p)] = os.path.getsize(p)
                except OSError:
                    continue
    with open(path, "w") as f:
        json.dump(sizes, f)


def _check(results: dict[str, Any], files: int) -> None:
    """Every epoch of every system: each sample exactly once, and the same bytes."""
    sums = {e["checksum"] for s in results["systems"].values() for e in s["epochs"]}
    reference = max(sums, key=lambda c: sum(e["checksum"] == c for s in results["systems"]
                                           .values() for e in s["epochs"])) if sums else ""
    results["reference_checksum"] = reference
    for s in results["systems"].values():
        s["all_samples_once"] = bool(s["epochs"]) and all(
            e["samples"] == files and e["distinct"] == files for e in s["epochs"])
        s["same_bytes"] = bool(s["epochs"]) and all(
            e["checksum"] == reference for e in s["epochs"])


def _machine() -> dict[str, Any]:
    import platform

    return {"cpus": os.cpu_count(), "python": platform.python_version(),
            "kernel": platform.release(), "load_average": list(os.getloadavg()),
            "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)}
