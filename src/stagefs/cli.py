"""The ``stagefs`` command: thin wrappers over the API, errors translated once, here."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import stat as st
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from stagefs import __version__
from stagefs._help import Formatter, bash_completion, commands, epilog
from stagefs._native import preload_library
from stagefs.config import check_flags, format_size, parse_size, show_path
from stagefs.errors import ConfigError, StagefsError
from stagefs.format.codecs import MAX_COMPRESSED
from stagefs.format.spec import FILE_ALIGN_MIN

__all__ = ["main"]

Handler = Callable[[argparse.Namespace], int]


class UsageError(Exception):
    """A command line that cannot mean anything (an argument missing, two that exclude each
    other): the command's usage and status 2, as argparse gives for the errors it finds."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, ``scancel``, Slurm's time limit), raised where the command is, so
    that it cleans up as after Ctrl-C (temporary data, claims, a FUSE server it started)."""


_TERMINATED = [False]  # SIGTERM came: set even where its exception is lost (an at-fork hook)
_HANDLER_PID = [0]  # the process that set _terminate (a forked child inherits it)


def _terminate(signum: int, frame: object) -> None:
    if os.getpid() != _HANDLER_PID[0]:
        # a forked child (a pool worker) before _parent_ends_child ran: its parent handles
        # SIGTERM. Raised in the child's at-fork hooks (filelock's runs first), the child
        # printed "Exception ignored in ... ensure_current_process" and a traceback
        return
    if _TERMINATED[0]:  # once: a second SIGTERM must not cut the cleanup of the first short
        return
    _TERMINATED[0] = True
    raise Terminated


def _parent_ends_child() -> None:
    """A forked child (a pool worker, which never execs) leaves SIGTERM to its parent: the
    parent stops handing out work, waits for what runs, and the child ends with it. Ended
    by the signal itself, the pool would break under the parent's cleanup (and Python 3.11
    prints a traceback for each cancelled task); raising in it, it would print one."""
    if signal.getsignal(signal.SIGTERM) is _terminate:
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)


os.register_at_fork(after_in_child=_parent_ends_child)


def _open(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    import stagefs

    return stagefs.open(args.pack)


def _size(text: str) -> int:
    """``parse_size`` as an option's type: a bad size is a usage error (status 2) naming
    the option, as a bad number is."""
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _is_raw(path: str) -> bool:
    """A directory of files used in place, not a pack."""
    from stagefs.format import MANIFEST_NAME

    return os.path.isdir(path) and not os.path.exists(os.path.join(path, MANIFEST_NAME))


def cmd_pack(args: argparse.Namespace) -> int:
    from stagefs.pack import describe, pack

    t0 = time.perf_counter()
    report = pack(args.src, args.dest, shard_size=args.shard_size,
                  compress=args.compress, align=args.align, jobs=args.jobs,
                  follow_symlinks=args.follow_symlinks, overwrite=args.force)
    dt = time.perf_counter() - t0
    rate = report.raw_bytes / dt / 2**20 if dt else 0.0
    print(f"{describe(report)} in {dt:.1f} s ({rate:.0f} MiB/s) → {report.dest}")
    return 0  # special files skipped: pack's warning named them


def cmd_unpack(args: argparse.Namespace) -> int:
    from stagefs.pack import unpack

    n = unpack(args.pack, args.dest)
    print(f"unpacked {n} files → {os.path.abspath(args.dest)}")
    return 0


def _ls_line(s: os.stat_result, name: str, link: str | None) -> str:
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(s.st_mtime))
    tail = f"{name} -> {link}" if link is not None else name
    return f"{st.filemode(s.st_mode)} {s.st_size:>12} {when} {tail}"


def cmd_ls(args: argparse.Namespace) -> int:
    with _open(args) as fs:
        path = args.path
        if not fs.isdir(path) or (fs.islink(path) and args.long):
            fs.lstat(path)  # a missing path is an error (as in ls), not a listing of its name
            entries = [(os.path.basename(path) or path, path)]
        else:
            entries = [(d.name, d.path) for d in fs.scandir(path)]
        for name, full in entries:
            if args.long:
                s = fs.lstat(full)
                link = fs.readlink(full) if st.S_ISLNK(s.st_mode) else None
                print(_ls_line(s, name, link))
            else:
                print(name)
    return 0


def cmd_stat(args: argparse.Namespace) -> int:
    with _open(args) as fs:
        s = fs.lstat(args.path)
        kind = ("directory" if st.S_ISDIR(s.st_mode) else
                "symbolic link" if st.S_ISLNK(s.st_mode) else "regular file")
        print(f"  File: {args.path or '/'}" + (f" -> {fs.readlink(args.path)}"
                                         if st.S_ISLNK(s.st_mode) else ""))
        print(f"  Size: {s.st_size}\tBlocks: {s.st_blocks}\tIO Block: {s.st_blksize}\t{kind}")
        print(f"Access: ({st.S_IMODE(s.st_mode):04o}/{st.filemode(s.st_mode)})  Inode: "
              f"{s.st_ino}  Links: {s.st_nlink}")
        print(f"Modify: {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(s.st_mtime))}."
              f"{s.st_mtime_ns % 1_000_000_000:09d}")
        if st.S_ISREG(s.st_mode) and _is_raw(args.pack):  # no shards: the file itself
            print(f" Bytes: {os.path.join(os.path.abspath(args.pack), args.path)} (a raw "
                  "directory: read in place, no checksum until a read computes it)")
        elif st.S_ISREG(s.st_mode):
            m = fs.manifest
            e = fs.namespace.entry(args.path, follow=False)
            codec = ("raw", "zstd")[m.codec[e]] if m.codec[e] < 2 else str(m.codec[e])
            print(f" Shard: {m.shards[m.shard[e]].name}  offset {m.offset[e]}  stored "
                  f"{m.stored[e]} ({codec})  xxh3 {m.checksum[e]:016x}")
    return 0


def cmd_cat(args: argparse.Namespace) -> int:
    """As cat: a file that cannot be read is said and the others are still written; the
    exit status is 1 if any could not be."""
    rc = 0
    with _open(args) as fs:
        out = sys.stdout.buffer
        for path in args.paths:
            try:
                with fs.open(path) as f:
                    while chunk := f.read(1 << 20):
                        out.write(chunk)
            except BrokenPipeError:
                raise
            except (StagefsError, OSError) as exc:
                out.flush()
                print(f"stagefs: error: {exc}", file=sys.stderr)
                rc = 1
        out.flush()
    return rc


def cmd_info(args: argparse.Namespace) -> int:
    from stagefs.namespace import accelerator

    raw = _is_raw(args.pack)
    with _open(args) as fs:
        info = fs.info()
    ratio = info["raw_bytes"] / info["stored_bytes"] if info["stored_bytes"] else 1.0
    rows = [
        ("raw directory", f"{info['pack']} (not a pack: its files are read in place)")
        if raw else ("pack", info["pack"]),
        ("files", f"{info['files']:,}"),
        ("directories", f"{info['directories']:,}"),
        ("symlinks", f"{info['symlinks']:,}"),
        ("bytes raw", f"{format_size(info['raw_bytes'])} ({info['raw_bytes']:,})"),
    ]
    if not raw:
        rows += [
            ("bytes stored", f"{format_size(info['stored_bytes'])} "
                             f"({info['stored_bytes']:,})"),
            ("compression", f"x{ratio:.2f} ({info['compressed_files']:,} files compressed)"),
            ("shards", f"{info['shards']} ({format_size(info['shard_bytes'])})"),
        ]
    rows.append(("C accelerator", accelerator()))
    rows.append(("preload library", preload_library() or "not built: 'stagefs run' serves "
                 "Python programs only (reinstall with a C compiler present)"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if raw:
        print(f"to pack it ({info['files']:,} files into a few shards, read with fewer "
              f"metadata operations): stagefs pack {args.pack} DEST")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from stagefs.verify import verify_pack

    report = verify_pack(args.pack, jobs=args.jobs)
    for c in report.corrupt:
        print(f"CORRUPT {show_path(c.path)} (in {c.shard}): {c.reason}")
    state = "OK" if report.ok else f"{len(report.corrupt)} CORRUPT"
    print(f"verified {report.files:,} files, {format_size(report.bytes)}: {state}")
    return 0 if report.ok else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from stagefs.bench.demo import run_demo

    return run_demo(origin=args.origin, size=args.size, out=args.out)


def _open_dataset(origin: str | None, tiers: list[str] | None,  # type: ignore[no-untyped-def]
                  connect: bool = False, runtime: str | None = None):
    """stagefs.open(origin), with ``tiers=`` when given and when stagefs.open takes it; or,
    with ``connect``, the cluster's store (stagefs.connect)."""
    import inspect

    import stagefs

    if connect:
        if origin:
            raise UsageError("give either a dataset or --connect, not both")
        if tiers:  # the cluster's reads go through the daemon's tiers: these would be unused
            raise UsageError("--tier is not used with --connect: this node's tiers are its "
                             "daemon's (stagefs serve --tier ...); drop --tier here")
        return stagefs.connect(runtime)
    if not origin:
        raise UsageError("name the dataset (a pack or a directory), or --connect")
    if tiers and "tiers" in inspect.signature(stagefs.open).parameters:
        return stagefs.open(origin, tiers=tiers, runtime=runtime)  # type: ignore[call-arg]
    if tiers:
        print("stagefs: warning: this stagefs has no tiers yet; reading from the origin",
              file=sys.stderr)
    return stagefs.open(origin, runtime=runtime)


def cmd_run(args: argparse.Namespace) -> int:
    import shutil

    from stagefs.posix import preload
    from stagefs.posix.intercept import Interceptor, _env_for, intercept_root, program_kind

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise UsageError("name the command after '--', e.g. -- python train.py")
    exe = shutil.which(cmd[0])
    if exe is None:  # as a shell, env or timeout says it: 127 not found, 126 not runnable
        there = os.sep in cmd[0] and os.path.exists(cmd[0])
        print(f"stagefs run: {cmd[0]}: "
              f"{'not an executable file' if there else 'command not found'}", file=sys.stderr)
        return 126 if there else 127
    served = preload.launch if preload_library() is not None else None
    if served is None and program_kind(cmd) == "native" and not args.any_program:
        raise ConfigError(
            f"{cmd[0]} is not a Python program, and the preload library that serves other "
            f"programs is not built (stagefs was installed without a C compiler), so "
            f"{cmd[0]} would see {args.at} as it is on disk. Reinstall stagefs with a C "
            f"compiler present, or mount the dataset with FUSE: stagefs mount DATASET "
            f"{args.at}; if {cmd[0]} starts Python that should be served, add --any-program")
    if args.dataset and not args.connect and os.path.isdir(args.dataset):
        intercept_root(args.at, args.dataset)  # before a raw tree's scan, as after it
    store = _open_dataset(args.dataset, args.tier, args.connect, args.runtime)
    try:  # a bad --at (/, or the dataset's own directory) is refused before anything starts
        root = Interceptor(store, args.at).root
        env = dict(os.environ, **_env_for(store, root))
    finally:
        store.close()
    for note in preload.notes(exe, root):
        print(f"stagefs run: warning: {note}", file=sys.stderr)
    if served is not None:
        env.update(served(lambda: _open_dataset(args.dataset, args.tier, args.connect,
                                                args.runtime), root))
    os.execve(exe, cmd, env)
    return 1  # not reached: the program replaced this process


def cmd_mount(args: argparse.Namespace) -> int:
    from stagefs.posix import fuse

    # a non-empty mount point (or a bad one) is refused before the dataset is opened
    fuse.check_mountpoint(args.mountpoint, nonempty=args.force_nonempty)
    cannot = fuse.fuse_available()  # (no /dev/fuse for this user: say so, and what works)
    if cannot:
        raise ConfigError(cannot)
    if args.foreground:
        with _open_dataset(args.dataset, args.tier, args.connect, args.runtime) as store:
            # libfuse ends its loop at SIGTERM (unmounting) only where nothing else handles it
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            fuse.mount(store, args.mountpoint, allow_other=args.allow_other,
                       nonempty=args.force_nonempty)
        fuse.remove_own_log()  # a detached server that ended cleanly leaves no log behind
        return 0
    # a bad dataset (or no cluster) is reported here, before anything is started
    _open_dataset(args.dataset, args.tier, args.connect, args.runtime).close()
    return fuse.mount_background(args.dataset, args.mountpoint, args.tier,
                                 allow_other=args.allow_other, nonempty=args.force_nonempty,
                                 connect=args.connect, runtime=args.runtime)


def cmd_umount(args: argparse.Namespace) -> int:
    from stagefs.posix.fuse import unmount

    unmount(args.mountpoint, lazy=args.lazy)
    return 0


def cmd_stage(args: argparse.Namespace) -> int:
    import stagefs
    from stagefs.stage import stage_with_progress

    with stagefs.open(args.origin, tiers=args.tier, runtime=args.runtime) as fs:
        counts, dt, nbytes = stage_with_progress(fs, progress=None if args.progress else False)
        held = len(fs.held_shards())
        shards = len(fs.manifest.shards)
    # each count first and named a shard count ("shards 11 not placed: ..." read as a shard
    # number), in the order things happened to them
    words = {"placed": "placed whole", "held": "held already",
             "elsewhere": "being placed by another process",
             "full": "not placed or placed in part (no room left in the tiers)",
             "failed": "failed"}
    order = [*words, *sorted(set(counts) - set(words))]
    done = ", ".join(f"{counts[k]} {words.get(k, k)}" for k in order if counts.get(k))
    print(f"staged {args.origin}: of its shards, {done or 'none to place'}; {held} of "
          f"{shards} shards held whole ({format_size(nbytes)} copied in {dt:.1f} s)")
    return 0 if counts.get("failed", 0) == 0 else 1


def cmd_status(args: argparse.Namespace) -> int:
    from stagefs.cluster.status import has_cluster, print_cluster_status, wait_for_cluster

    if args.wait_staged is not None:  # the daemons may not have started yet
        waited = args.wait_staged
        args.wait_staged = wait_for_cluster(args.runtime, args.wait_staged)
        if not has_cluster(args.runtime):  # (a daemon with --wait writes it once staged)
            where = args.runtime or "this job's runtime directory"
            print(f"stagefs status: no cluster daemon has written {where} within "
                  f"{waited:g} s: not staged (is 'stagefs serve' running on this node?)",
                  file=sys.stderr)
            return 1
    if has_cluster(args.runtime):  # a cluster daemon runs on this node: show the cluster
        return print_cluster_status(args.runtime, as_json=args.json,
                                    wait_staged=args.wait_staged)
    from stagefs.stage import print_status

    return print_status(args.runtime, as_json=args.json)


def cmd_serve(args: argparse.Namespace) -> int:
    from stagefs.cluster.bootstrap import new_token_file
    from stagefs.cluster.daemon import ServeOptions, serve

    if args.new_token:
        new_token_file(args.new_token)
        print(f"wrote a new job token to {args.new_token} (mode 0600)")
        return 0
    if not args.origin:
        raise UsageError("the following arguments are required: origin (or --new-token)")
    return serve(ServeOptions(
        origin=args.origin, tiers=args.tier or [], replicas=args.replicas,
        replicate_all=args.replicate_all or [], runtime=args.runtime, wait=args.wait,
        hosts=args.hosts, rank=args.rank, token_file=args.token_file, bind=args.bind,
        interface=args.interface, port=args.port, seed=args.seed, progress=args.progress,
        mpi=args.mpi, clean_on_exit=args.clean_on_exit, dead_after=args.dead_after,
        transport=args.transport))


def cmd_clean(args: argparse.Namespace) -> int:
    from stagefs.runtime import Runtime, clean

    rt = Runtime(args.runtime)
    every = rt.jobs()
    removed = clean(every if args.all_jobs else [rt], force=args.force, others=every)
    print("\n".join(f"removed {p}" for p in removed) or f"nothing to clean ({rt.path})")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from stagefs.doctor import check_node, render

    findings = check_node(args.tier)
    print(render(findings))
    bad = [f.check for f in findings if f.status == "error"]
    if bad:
        print(f"stagefs doctor: unusable: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


def _bench_command(args: argparse.Namespace) -> str:
    """The command line that reproduces this bench (every option spelled out)."""
    parts = ["stagefs bench", f"--dataset {args.dataset}", f"--files {args.files}",
             f"--epochs {args.epochs}", f"--runs {args.runs}"]
    parts += [f"--origin {args.origin}"] if args.origin else []
    parts += ["--systems " + " ".join(args.systems)] if args.systems else []
    parts += [f"--{k.replace('_', '-')} {v}" for k, v in (("work", args.work),
              ("local", args.local), ("peer_python", args.peer_python)) if v]
    parts += ["--no-drop-caches"] if args.no_drop_caches else []
    return " ".join([*parts, f"--out {args.out}"])


def cmd_bench(args: argparse.Namespace) -> int:
    from stagefs.bench.runner import BenchConfig, run_bench

    cfg = BenchConfig(dataset=args.dataset, files=args.files, origin=args.origin,
                      epochs=args.epochs, runs=args.runs, systems=args.systems, out=args.out,
                      work=args.work, local=args.local, peer_python=args.peer_python,
                      keep=args.keep, drop_caches=not args.no_drop_caches,
                      command=_bench_command(args))
    results = run_bench(cfg)
    from stagefs.bench.report import summary_table

    print(summary_table(results))
    print(f"written to {os.path.abspath(args.out)}")
    systems = results["systems"]
    # a system that failed (no epoch ran) is not one that read wrong bytes: say which
    failed = {n: s["errors"][-1].strip().splitlines()[-1][:300]
              for n, s in systems.items() if s.get("errors") and not s.get("epochs")}
    wrong = [n for n, s in systems.items() if n not in failed
             and not (s.get("all_samples_once") and s.get("same_bytes"))]
    for n, why in failed.items():
        print(f"stagefs bench: {n} failed: {why}", file=sys.stderr)
    # failed in some runs: its medians are over the others only
    partly = {n: s["errors"] for n, s in systems.items() if s.get("errors") and s.get("epochs")}
    for n, errors in partly.items():
        print(f"stagefs bench: {n}: {len(errors)} of {results['runs']} runs failed: "
              f"{errors[-1].strip().splitlines()[-1][:300]}", file=sys.stderr)
    # a system asked for by name that could not run is a failure, not a footnote
    absent = {n: why for n, why in results["skipped"].items() if n in results["requested"]}
    for n, why in absent.items():
        print(f"stagefs bench: {n} could not run: {why.splitlines()[0]}", file=sys.stderr)
    if not systems:
        print("stagefs bench: no system ran: nothing was measured", file=sys.stderr)
    if wrong:
        print(f"stagefs bench: these systems did not read every sample once with the same "
              f"bytes: {', '.join(wrong)}", file=sys.stderr)
    return 1 if failed or partly or absent or wrong or not systems else 0


def cmd_completion(args: argparse.Namespace) -> int:
    print(bash_completion(build_parser()), end="")
    return 0


class _CommandParser(argparse.ArgumentParser):
    """A command's parser; one whose ``intermixed`` is set takes its positionals before,
    between and after its options (``stagefs mount PACK --tier T MNT``). Plain argparse
    gives a command with an optional positional first (``[dataset] mountpoint``) every
    positional it has at the first one, and then called the mount point an unrecognized
    argument."""

    intermixed = False

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        if not self.intermixed:
            return super().parse_known_args(args, namespace)
        self.intermixed = False  # parse_known_intermixed_args calls back here, twice
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self.intermixed = True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stagefs", formatter_class=Formatter, epilog=epilog(None),
        description="A transient, read-optimised file system for training data on clusters.",
    )
    p.add_argument("--version", action="version", version=f"stagefs {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log what stagefs does")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           parser_class=_CommandParser)

    def add(name: str, handler: Handler, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=textwrap.fill(help, 88),
                            formatter_class=Formatter, epilog=epilog(name))
        sp.set_defaults(handler=handler)
        # after the command too (stagefs serve ... -v), as scripts add it at the end
        sp.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="log what stagefs does (as stagefs -v COMMAND)")
        return sp

    sp = add("pack", cmd_pack, "pack a directory tree into shards and a manifest")
    sp.add_argument("src", help="the directory to pack")
    sp.add_argument("dest", help="the pack directory to write")
    sp.add_argument("--shard-size", type=_size, default="64MiB", metavar="SIZE",
                    help="target shard size")
    sp.add_argument("--compress", choices=("auto", "zstd", "none"), default="auto",
                    help="auto: keep zstd only where it saves space; a file over "
                    f"{MAX_COMPRESSED // 2**20} MiB is always stored raw (a compressed file is "
                    "decoded whole)")
    sp.add_argument("--align", type=_size, default="4096", metavar="SIZE",
                    help=f"start each raw file of {FILE_ALIGN_MIN // 1024} KiB or more at a "
                         "multiple of SIZE in its shard, so that it can be mapped from a tier "
                         "copy with no copy (a power of two; 1 or 0: no padding)")
    sp.add_argument("-j", "--jobs", type=int, default=None,
                    help="worker processes (default: one per core, at most 8)")
    sp.add_argument("--follow-symlinks", action="store_true",
                    help="pack what symlinks pointing out of the tree point to")
    sp.add_argument("--force", action="store_true", help="replace what is at DEST")

    sp = add("unpack", cmd_unpack, "restore the tree of a pack, byte for byte")
    sp.add_argument("pack", help="the pack directory")
    sp.add_argument("dest", help="the directory to write the tree into")

    sp = add("ls", cmd_ls, "list a directory of a pack")
    sp.add_argument("pack", help="the pack directory")
    sp.add_argument("path", nargs="?", default="",
                    help="a path inside the pack (default: its root)")
    sp.add_argument("-l", "--long", action="store_true", help="mode, size, mtime")

    sp = add("stat", cmd_stat, "show the stat fields of a path, and where its bytes are")
    sp.add_argument("pack", help="the pack directory")
    sp.add_argument("path", help="a path inside the pack")

    sp = add("cat", cmd_cat, "write files of a pack to standard output")
    sp.add_argument("pack", help="the pack directory")
    sp.add_argument("paths", nargs="+", metavar="path", help="paths inside the pack")

    sp = add("info", cmd_info, "files, directories, bytes raw and stored, shards")
    sp.add_argument("pack", help="the pack directory")

    sp = add("verify", cmd_verify, "check every file against its checksum")
    sp.add_argument("pack", help="the pack directory")
    sp.add_argument("-j", "--jobs", type=int, default=None,
                    help="worker processes (default: one per core, at most 8)")

    sp = add("demo", cmd_demo, "plain files against stagefs, three epochs on the same data")
    sp.add_argument("--origin", default=None, metavar="DIR",
                    help="the dataset's directory: its files are used, or a dataset is "
                    "generated there when it is empty or missing, and kept (default: a temp "
                    "dir on the test PFS at /tmp/pfs if mounted, else a local temp dir)")
    sp.add_argument("--size", type=_size, default=None, metavar="N",
                    help="bytes to generate, e.g. 300MiB or 1GB (default 768MiB: about a "
                    "minute on 2 cores)")
    sp.add_argument("--out", default="stagefs-demo", metavar="DIR",
                    help="where the PNG chart goes (default ./stagefs-demo)")

    sp = add("run", cmd_run, "run a command with the dataset served at --at (any dynamically "
             "linked program; no FUSE, no root)")
    sp.add_argument("--dataset", help="the pack (or origin) to serve")
    sp.add_argument("--at", required=True, help="the path the program reads the data from")
    sp.add_argument("--tier", action="append", default=None, metavar="DIR[:SIZE]",
                    help="a node-local tier, fastest first (repeat; default: $STAGEFS_TIERS)")
    sp.add_argument("--connect", action="store_true",
                    help="serve the cluster's dataset (this node's daemon and its tiers; "
                         "not with --tier) instead")
    sp.add_argument("--runtime", default=None, metavar="DIR",
                    help="the cluster's runtime dir (--connect)")
    sp.add_argument("--any-program", action="store_true",
                    help="accepted for old scripts; every dynamically linked program is "
                         "served. Without the preload library built: run a program that is "
                         "not Python anyway (only the Python it starts is served)")
    sp.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")

    sp = add("mount", cmd_mount, "mount a dataset read-only with FUSE (any program can read it)")
    sp.add_argument("dataset", nargs="?", help="the pack (or origin) to serve")
    sp.add_argument("mountpoint", help="an existing, empty directory")
    sp.intermixed = True  # type: ignore[attr-defined]  # stagefs mount PACK --tier T MNT
    sp.add_argument("--tier", action="append", default=None, metavar="DIR[:SIZE]",
                    help="a node-local tier, fastest first (repeat; default: $STAGEFS_TIERS)")
    sp.add_argument("--connect", action="store_true",
                    help="serve the cluster's whole dataset (this node's daemon and its "
                         "tiers; not with --tier) instead")
    sp.add_argument("--runtime", default=None, metavar="DIR",
                    help="the cluster's runtime dir (--connect)")
    sp.add_argument("-f", "--foreground", action="store_true",
                    help="stay in the foreground until unmounted or interrupted")
    sp.add_argument("--allow-other", action="store_true", help="let other users read it")
    sp.add_argument("--force-nonempty", action="store_true",
                    help="mount over a directory that holds files (they are hidden until "
                         "unmounted)")

    sp = add("umount", cmd_umount, "unmount a 'stagefs mount'")
    sp.add_argument("mountpoint", help="where it is mounted")
    sp.add_argument("-l", "--lazy", action="store_true",
                    help="detach a busy mount now (programs using it keep what they have "
                         "open; its server ends when the last lets go)")

    sp = add("stage", cmd_stage, "copy a dataset into the node-local tiers now (resumable)")
    sp.add_argument("origin", help="a pack, or a raw directory to use in place")
    sp.add_argument("--tier", action="append", default=None, metavar="DIR[:SIZE]",
                    help="a node-local tier, fastest first (repeat; default: $STAGEFS_TIERS)")
    sp.add_argument("--runtime", default=None, metavar="DIR",
                    help="the job's runtime dir ($STAGEFS_RUNTIME)")
    sp.add_argument("--no-progress", dest="progress", action="store_false",
                    help="no progress bar")

    sp = add("status", cmd_status, "per tier: bytes used, shards held; reads by holder and "
             "hit rate, from every process of the job; origin operations")
    sp.add_argument("--runtime", default=None, metavar="DIR",
                    help="the job's runtime dir ($STAGEFS_RUNTIME)")
    sp.add_argument("--json", action="store_true", help="print JSON")
    sp.add_argument("--wait-staged", type=float, default=None, metavar="SECONDS",
                    help="cluster: wait up to SECONDS until every node has staged")

    sp = add("serve", cmd_serve, "the per-node cluster daemon: stage this node's shards, "
             "serve them to the other nodes (launch one per node with mpirun/srun)")
    sp.add_argument("origin", nargs="?", help="the pack to serve (on the shared file system)")
    sp.add_argument("--tier", action="append", metavar="DIR[:SIZE]",
                    help="a node-local tier, fastest first (repeat); {rank} is expanded")
    sp.add_argument("--replicas", type=int, default=1, help="copies of each shard")
    sp.add_argument("--replicate-all", action="extend", nargs="+", metavar="GLOB",
                    help="subtrees to place on every node (e.g. val)")
    sp.add_argument("--runtime", default=None, metavar="DIR",
                    help="this node's runtime dir ({rank} expanded; default: per user and job)")
    sp.add_argument("--wait", action="store_true",
                    help="publish the runtime dir only once every node has staged")
    sp.add_argument("--clean-on-exit", action="store_true",
                    help="remove this node's tier data when the daemon stops (SIGTERM from "
                         "the job script, scancel or the time limit)")
    sp.add_argument("--hosts", default=None, metavar="FILE",
                    help="static bootstrap: one ADDR[:PORT] per line, rank 0 first (no MPI)")
    sp.add_argument("--rank", type=int, default=None, help="this node's line in --hosts")
    sp.add_argument("--token-file", default=None, help="static bootstrap: the job token file")
    sp.add_argument("--new-token", default=None, metavar="FILE",
                    help="write a new job token to FILE (for --token-file) and exit")
    sp.add_argument("--bind", default=None, metavar="ADDR", help="address to listen on")
    sp.add_argument("--interface", default=None, metavar="NAME",
                    help="listen on this interface's address ($STAGEFS_INTERFACE)")
    sp.add_argument("--port", type=int, default=None, help="port (default: any free one)")
    sp.add_argument("--seed", type=int, default=0, help="placement seed")
    sp.add_argument("--dead-after", type=float, default=30.0, metavar="SECONDS",
                    help="a node whose probes fail this long is dead: its shards are copied "
                         "again from the survivors")
    sp.add_argument("--progress", type=float, default=5.0, metavar="SECONDS",
                    help="rank 0 reports staging progress this often (0: never)")
    sp.add_argument("--mpi", action=argparse.BooleanOptionalAction, default=None,
                    help="use MPI to bootstrap (default: if an MPI launcher started us)")
    sp.add_argument("--transport", choices=("tcp", "mpi"), default="tcp",
                    help="how daemons read each other's shards (staging copies, the "
                         "ranges relayed for their readers): tcp, or mpi (the daemons are MPI "
                         "ranks; the MPI library's fabric, RDMA where it has one); "
                         "re-replication uses TCP")

    sp = add("clean", cmd_clean, "remove this job's tier data and runtime directory (staged "
             "data is otherwise kept for the next job); refused while a process uses them")
    sp.add_argument("--runtime", default=None, metavar="DIR",
                    help="the job's runtime dir ($STAGEFS_RUNTIME)")
    sp.add_argument("--all", dest="all_jobs", action="store_true",
                    help="every job of yours on this node (under the default runtime base)")
    sp.add_argument("--force", action="store_true",
                    help="clean even while live processes use the runtime")

    sp = add("doctor", cmd_doctor, "check this node (FUSE, /dev/shm, tiers, accelerator, MPI, "
             "Slurm, memory, socket buffers, open files) and say what each finding means")
    sp.add_argument("--tier", action="append", default=None, metavar="DIR[:SIZE]",
                    help="a tier to check: free space, write and read speed (repeat; "
                         "default: $STAGEFS_TIERS)")

    sp = add("bench", cmd_bench, "compare shuffled epochs: plain files, stagefs, and the peers")
    sp.add_argument("--dataset", choices=("imagenet-like", "npz"), default="imagenet-like",
                    help="what to generate: small JPEG-like files, or larger .npz arrays")
    sp.add_argument("--files", type=int, default=2000, help="files to generate")
    sp.add_argument("--origin", default=None,
                    help="the dataset directory (on the shared FS); generated there if empty")
    sp.add_argument("--epochs", type=int, default=3, help="epochs per run")
    sp.add_argument("--runs", type=int, default=3, help="runs; medians are reported")
    sp.add_argument("--systems", nargs="+", default=None, metavar="SYSTEM",
                    help="only these (default: every one installed)")
    sp.add_argument("--out", default="bench-results", help="where the report goes")
    sp.add_argument("--work", default=None,
                    help="where conversions go (default: ORIGIN.bench, next to the origin)")
    sp.add_argument("--local", default=None,
                    help="node-local scratch for copies, caches, tiers (default: /dev/shm)")
    sp.add_argument("--peer-python", default=None,
                    help="the Python that has the peers installed (default: "
                         "$STAGEFS_BENCH_PEER_PYTHON, else this one)")
    sp.add_argument("--keep", action="store_true", help="keep conversions and local copies")
    sp.add_argument("--no-drop-caches", action="store_true",
                    help="do not drop the page cache before cold epochs (it needs root)")

    sp = add("completion", cmd_completion, "print a shell completion script")
    sp.add_argument("shell", choices=("bash",), help="bash (zsh too, with bashcompinit)")

    for sp in commands(p).values():  # whatever uses a job's runtime can name the job
        if any("--runtime" in a.option_strings for a in sp._actions):
            sp.add_argument("--job", default=None, metavar="NAME",
                            help="the job whose runtime to use ($STAGEFS_JOB; default: the "
                                 "batch job, else this login session)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:  # bare `stagefs`: the overview, not an error
        parser.print_help()
        return 0
    args, extra = parser.parse_known_args(argv)
    command = commands(parser)[args.command]
    if extra:  # the command's error, with its usage (argparse's would show the top one's)
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "job", None):  # for this command and every process it starts
        os.environ["STAGEFS_JOB"] = args.job
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:  # names are bytes: write those that are not UTF-8 as they are
        reconfigure(errors="surrogateescape")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="stagefs: %(levelname)s: %(message)s")
    with _terminated_as_interrupt():
        try:
            rc = _run(command, args)
        except Exception:
            if not _TERMINATED[0]:
                raise
            rc = 1  # an error SIGTERM made (a pool whose worker it ended): terminated, below
        if _TERMINATED[0] and rc != 128 + signal.SIGTERM:
            print("stagefs: terminated", file=sys.stderr)
            rc = 128 + signal.SIGTERM
        return rc


@contextlib.contextmanager
def _terminated_as_interrupt() -> Iterator[None]:
    """SIGTERM raises Terminated for the length of the command (a command that handles it
    itself, the daemon and a FUSE server, sets its own handler); one ignored stays ignored."""
    old = signal.getsignal(signal.SIGTERM)
    _TERMINATED[0] = False
    if old != signal.SIG_DFL or threading.current_thread() is not threading.main_thread():
        yield
        return
    _HANDLER_PID[0] = os.getpid()
    signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _run(command: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The command's handler, its errors made an exit status and a line on stderr."""
    try:
        if args.command != "doctor":  # (which reports a bad switch among its findings)
            check_flags()
        return int(args.handler(args))
    except UsageError as exc:
        command.error(str(exc))
    except Terminated:
        print("stagefs: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("stagefs: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of our output went away (`stagefs verify | head`). As a program killed
        # by SIGPIPE: status 141, never 0, so `set -o pipefail` cannot take a listing cut
        # short for a check that passed; stdout is pointed at /dev/null so the flush at
        # exit does not raise again.
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return 128 + signal.SIGPIPE
    except (StagefsError, OSError) as exc:
        print(f"stagefs: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
