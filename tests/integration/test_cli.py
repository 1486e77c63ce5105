"""The ``stagefs`` command, run as users run it: the installed console script, in a
subprocess."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import stagefs
from conftest import build_sample_tree, snapshot_tree
from stagefs.errors import CorruptManifestError, CorruptShardError
from stagefs.format import MANIFEST_NAME, shard_name
from stagefs.posix.fuse import fuse_available, is_mounted

pytestmark = pytest.mark.integration

EXE = shutil.which("stagefs")


def run(*args: str | bytes | Path, ok: bool = True, timeout: float = 120,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    if EXE is None:
        pytest.skip("the stagefs console script is not on PATH (pip install -e .)")
    env = {**os.environ, "COLUMNS": "120", **(env or {})}
    argv = [EXE, *(a if isinstance(a, bytes) else str(a) for a in args)]
    proc = subprocess.run(argv, capture_output=True, timeout=timeout, env=env, check=False)
    if ok:
        assert proc.returncode == 0, proc.stderr.decode()
        assert b"Traceback" not in proc.stderr
    return proc


def one_line_error(proc: subprocess.CompletedProcess[bytes], *needles: str) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    err = proc.stderr.decode()
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("stagefs: error: "), err
    for n in needles:
        assert n in lines[0], (n, err)
    return lines[0]


@pytest.fixture(scope="module")
def cli_pack(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("cli")
    src = build_sample_tree(base / "src")
    proc = run("pack", src, base / "pack", "--shard-size", "64KiB", "--jobs", "2")
    out = proc.stdout.decode()
    assert "packed 10 files, 5 directories, 5 symlinks" in out and str(base / "pack") in out
    return src, base / "pack"


def test_version() -> None:
    proc = run("--version")
    assert proc.stdout.decode().strip() == f"stagefs {stagefs.__version__}"


def test_help_lists_the_commands() -> None:
    out = run("--help").stdout.decode()
    for cmd in ("pack", "unpack", "ls", "stat", "cat", "info", "verify", "demo"):
        assert cmd in out


def test_info(cli_pack: tuple[Path, Path]) -> None:
    out = run("info", cli_pack[1]).stdout.decode()
    fields = dict(line.split(None, 1) if " " in line else (line, "")
                  for line in out.replace("bytes raw", "bytes_raw")
                  .replace("bytes stored", "bytes_stored").splitlines())
    assert fields["files"].strip() == "10"
    assert fields["directories"].strip() == "5"
    assert fields["symlinks"].strip() == "5"
    raw = sum(len(n.content) for n in snapshot_tree(cli_pack[0]).values() if n.kind == "file")
    assert f"({raw:,})" in fields["bytes_raw"]
    assert fields["compression"].startswith("x") and "shards" in fields


def test_ls(cli_pack: tuple[Path, Path]) -> None:
    src, pack = cli_pack
    out = run("ls", pack).stdout.decode()
    # a name holding a newline would break lines; the sample tree has none
    assert sorted(out.splitlines()) == sorted(os.listdir(src))
    assert sorted(run("ls", pack, "img").stdout.decode().splitlines()) == sorted(
        os.listdir(src / "img"))
    assert run("ls", pack, "/data/").stdout.decode().splitlines() == ["arr.npy", "nested",
                                                                      "rand.bin"]
    assert run("ls", pack, "a.txt").stdout.decode().strip() == "a.txt"


def test_ls_long(cli_pack: tuple[Path, Path]) -> None:
    pack = cli_pack[1]
    lines = run("ls", "-l", pack).stdout.decode().splitlines()
    by_name = {line.split()[-1] if " -> " not in line else line.split(" -> ")[0].split()[-1]:
               line for line in lines}
    assert by_name["a.txt"].startswith("-rw-r--r--") and " 5000 " in by_name["a.txt"]
    assert by_name["exec.sh"].startswith("-rwxr-xr-x")
    assert by_name["emptydir"].startswith("drwx------")
    assert by_name["link_file"].startswith("l") and by_name["link_file"].endswith(
        "link_file -> a.txt")
    assert by_name["link_dangling"].endswith("-> nowhere")
    link = run("ls", "-l", pack, "link_dir").stdout.decode().strip()
    assert link.startswith("l") and link.endswith("link_dir -> img")


def test_stat(cli_pack: tuple[Path, Path]) -> None:
    src, pack = cli_pack
    out = run("stat", pack, "img/cat.jpg").stdout.decode()
    real = os.stat(src / "img/cat.jpg")
    assert "File: img/cat.jpg" in out and f"Size: {real.st_size}" in out
    assert "regular file" in out and "(0644/-rw-r--r--)" in out
    assert f"{real.st_mtime_ns % 10**9:09d}" in out and "Shard: shard-" in out
    assert "(raw)" in out  # a JPEG is stored raw
    out = run("stat", pack, "link_chain").stdout.decode()
    assert "symbolic link" in out and "-> link_file" in out
    out = run("stat", pack, "data").stdout.decode()
    assert "directory" in out and "Links: 3" in out


def test_cat(cli_pack: tuple[Path, Path]) -> None:
    src, pack = cli_pack
    for rel in ("a.txt", "data/rand.bin", "data/arr.npy", "empty.bin", "link_chain",
                "we ird name.txt", "-dash"):
        assert run("cat", pack, "--", rel).stdout == (src / rel).read_bytes(), rel
    both = run("cat", pack, "img/cat.jpg", "img/dog.jpg").stdout
    assert both == (src / "img/cat.jpg").read_bytes() + (src / "img/dog.jpg").read_bytes()
    # as cat: a name that is not there is said, the others still written, and the status 1
    r = run("cat", pack, "img/cat.jpg", "img/nope.jpg", "img/dog.jpg", ok=False)
    assert r.returncode == 1 and b"Traceback" not in r.stderr
    assert r.stdout == both and b"img/nope.jpg" in r.stderr


def test_unpack(cli_pack: tuple[Path, Path], tmp_path: Path) -> None:
    src, pack = cli_pack
    out = tmp_path / "out"
    proc = run("unpack", pack, out)
    assert "unpacked 10 files" in proc.stdout.decode()
    assert snapshot_tree(out) == snapshot_tree(src)
    one_line_error(run("unpack", pack, out, ok=False), str(out), "not empty")


def test_verify_ok_and_corrupt(cli_pack: tuple[Path, Path], tmp_path: Path) -> None:
    pack = tmp_path / "pack"
    shutil.copytree(cli_pack[1], pack)
    proc = run("verify", pack)
    assert "verified 10 files" in proc.stdout.decode() and "OK" in proc.stdout.decode()
    proc = run("verify", "--jobs", "1", pack)
    assert "OK" in proc.stdout.decode()
    with stagefs.open(pack) as fs:
        m = fs.manifest
        e = m.lookup(b"data/rand.bin")
        shard, off = m.shards[m.shard[e]].name, int(m.offset[e]) + 1234
    with open(pack / shard, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))
    proc = run("verify", pack, ok=False)
    assert proc.returncode != 0 and b"Traceback" not in proc.stderr
    out = proc.stdout.decode()
    assert f"CORRUPT data/rand.bin (in {shard})" in out
    assert [line for line in out.splitlines() if line.startswith("CORRUPT")] == [
        f"CORRUPT data/rand.bin (in {shard}): checksum mismatch"]
    assert "1 CORRUPT" in out
    # reading it fails too, naming the path and the shard; other files still read
    line = one_line_error(run("cat", pack, "data/rand.bin", ok=False), "data/rand.bin", shard)
    assert "checksum" in line
    assert run("cat", pack, "a.txt").stdout == (cli_pack[0] / "a.txt").read_bytes()


def test_verify_truncated_shard(cli_pack: tuple[Path, Path], tmp_path: Path) -> None:
    pack = tmp_path / "pack"
    shutil.copytree(cli_pack[1], pack)
    shard = pack / shard_name(0)
    os.truncate(shard, shard.stat().st_size - 10)
    proc = run("verify", pack, ok=False)
    assert proc.returncode != 0 and b"Traceback" not in proc.stderr
    assert shard_name(0) in proc.stdout.decode() + proc.stderr.decode()


def test_errors_are_one_line(cli_pack: tuple[Path, Path], tmp_path: Path) -> None:
    src, pack = cli_pack
    missing = tmp_path / "no-such-pack"
    for cmd in ("info", "ls", "verify"):
        one_line_error(run(cmd, missing, ok=False), str(missing))
    one_line_error(run("cat", missing, "x", ok=False), str(missing))
    one_line_error(run("cat", pack, "nope.txt", ok=False), "nope.txt")
    one_line_error(run("stat", pack, "img/nope", ok=False), "img/nope")
    one_line_error(run("ls", pack, "nope", ok=False), "nope")
    one_line_error(run("cat", pack, "img", ok=False), "img")
    one_line_error(run("ls", pack, "a.txt/x", ok=False), "a.txt/x")
    # a directory of plain files is a dataset used in place, but verify needs a pack
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "file").write_bytes(b"x")
    one_line_error(run("verify", plain, ok=False), str(plain), "manifest")
    empty = tmp_path / "empty"
    empty.mkdir()
    for cmd in ("info", "ls", "verify"):
        one_line_error(run(cmd, empty, ok=False), str(empty))
    one_line_error(run("info", src / "a.txt", ok=False), str(src / "a.txt"))
    interrupted = tmp_path / "interrupted"
    (interrupted / ".stagefs-pack").mkdir(parents=True)
    (interrupted / shard_name(0)).write_bytes(b"x" * 100)
    one_line_error(run("ls", interrupted, ok=False), str(interrupted), "stagefs pack")
    bad = run("pack", src, tmp_path / "p", "--shard-size", "lots", ok=False)  # as -j x: usage
    assert bad.returncode == 2 and b"--shard-size: not a size: 'lots'" in bad.stderr
    one_line_error(run("pack", src, tmp_path / "p", "--shard-size", "0", ok=False), "size")
    one_line_error(run("pack", tmp_path / "nowhere", tmp_path / "p", ok=False), "nowhere")
    one_line_error(run("pack", src, tmp_path / "p", "-j", "-1", ok=False), "--jobs", "-1")
    one_line_error(run("verify", pack, "-j", "-2", ok=False), "--jobs", "-2")
    one_line_error(run("pack", src, pack, ok=False), str(pack), "--force")
    assert not (tmp_path / "p").exists()


def test_pack_refuses_outside_symlink_then_follows(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (tmp_path / "outside.txt").write_bytes(b"out\n")
    os.symlink(tmp_path / "outside.txt", src / "escape")
    one_line_error(run("pack", src, tmp_path / "p", ok=False), "escape", "--follow-symlinks")
    run("pack", src, tmp_path / "p", "--follow-symlinks")
    assert run("cat", tmp_path / "p", "escape").stdout == b"out\n"


def test_verify_names_each_corrupt_file_on_its_line(tmp_path: Path) -> None:
    """A corrupt file whose name holds a newline or bytes that are not UTF-8 is one CORRUPT
    line, its name quoted, as the errors that name it."""
    src = tmp_path / "src"
    src.mkdir()
    names = [b"two\nlines", b"bad\xff", b"plain"]
    for n in names:
        Path(os.fsdecode(os.path.join(os.fsencode(src), n))).write_bytes(n * 100)
    run("pack", src, tmp_path / "p", "--compress", "none")
    with stagefs.open(tmp_path / "p") as fs:
        m = fs.manifest
        for n in names:
            e = m.lookup(n)
            with open(tmp_path / "p" / m.shards[m.shard[e]].name, "r+b") as f:
                f.seek(int(m.offset[e]))
                f.write(b"X")
    out = run("verify", tmp_path / "p", ok=False).stdout.decode("utf-8", "surrogateescape")
    shard = "shard-000000.sfs"
    assert [line for line in out.splitlines() if not line.startswith("verified")] == [
        f"CORRUPT 'bad\\udcff' (in {shard}): checksum mismatch",
        f"CORRUPT plain (in {shard}): checksum mismatch",
        f"CORRUPT 'two\\nlines' (in {shard}): checksum mismatch"]


def test_pack_reports_skipped_special_files(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"f")
    os.mkfifo(src / "pipe")
    os.mkfifo(src / "two\nlines")
    proc = run("pack", src, tmp_path / "p", "--compress", "none")
    err = proc.stderr.decode()
    # once, each name on the warning's one line (a newline shown quoted)
    assert err.count("skipped") == 1 and err.count("pipe") == 1
    assert [line for line in err.splitlines() if "skipped" in line] == [
        "stagefs: WARNING: skipped 2 special files (sockets, FIFOs, devices): pipe, "
        "'two\\nlines'"]


def test_usage_errors_exit_2() -> None:
    proc = run("pack", ok=False)
    assert proc.returncode == 2 and b"usage:" in proc.stderr and b"Traceback" not in proc.stderr
    proc = run("pack", "a", "b", "--compress", "lz4", ok=False)
    assert proc.returncode == 2 and b"lz4" in proc.stderr


def test_names_that_are_not_utf8(tmp_path: Path) -> None:
    """Names are bytes: listed and accepted as they are, even where stdout is strict UTF-8."""
    src = os.fsencode(tmp_path / "src")
    os.makedirs(os.path.join(src, b"d\xfe"))
    for name, data in [(b"bad\xffname", b"x"), (b"ok", b"y"), (b"d\xfe/in\xe9", b"z")]:
        with open(os.path.join(src, name), "wb") as f:
            f.write(data)
    pack = tmp_path / "pack"
    run("pack", src, pack)
    strict = {"PYTHONIOENCODING": "utf-8", "LC_ALL": "C.UTF-8", "PYTHONUTF8": "0"}
    assert run("ls", pack, env=strict).stdout.splitlines() == [b"bad\xffname", b"d\xfe", b"ok"]
    assert run("ls", pack, b"d\xfe", env=strict).stdout.splitlines() == [b"in\xe9"]
    long = run("ls", "-l", pack, env=strict).stdout.splitlines()
    assert [line.rsplit(b" ", 1)[1] for line in long] == [b"bad\xffname", b"d\xfe", b"ok"]
    assert b"File: d\xfe/in\xe9" in run("stat", pack, b"d\xfe/in\xe9", env=strict).stdout
    assert run("cat", pack, b"bad\xffname", env=strict).stdout == b"x"
    one_line_error(run("cat", pack, b"missing\xff", ok=False, env=strict), "missing")


# ------------------------------------------------------------- bad input, clear errors

ADVICE = "copy the pack again or re-pack"


def test_a_manifest_that_is_a_directory(cli_pack: tuple[Path, Path], tmp_path: Path) -> None:
    pack = tmp_path / "pack"
    shutil.copytree(cli_pack[1], pack)
    manifest = pack / MANIFEST_NAME
    manifest.unlink()
    manifest.mkdir()
    for args in (["info", pack], ["ls", pack], ["cat", pack, "a.txt"], ["verify", pack],
                 ["unpack", pack, tmp_path / "out"]):
        one_line_error(run(*args, ok=False), str(manifest), "not a file", ADVICE)


def test_a_pack_path_that_is_a_file(cli_pack: tuple[Path, Path], tmp_path: Path) -> None:
    shard = cli_pack[1] / shard_name(0)
    for args in (["info", shard], ["ls", shard], ["cat", shard, "a.txt"], ["verify", shard],
                 ["unpack", shard, tmp_path / "out"]):
        one_line_error(run(*args, ok=False), str(shard), "directory", MANIFEST_NAME)
    assert not (tmp_path / "out").exists()


def test_a_truncated_shard_is_named_with_what_to_do(cli_pack: tuple[Path, Path],
                                                    tmp_path: Path) -> None:
    src, pack = tmp_path / "src", tmp_path / "pack"
    shutil.copytree(cli_pack[1], pack)
    with stagefs.open(pack) as fs:
        m = fs.manifest
        e = m.lookup(b"data/rand.bin")
        shard = pack / m.shards[m.shard[e]].name
    os.truncate(shard, shard.stat().st_size // 2)
    line = one_line_error(run("cat", pack, "data/rand.bin", ok=False), str(shard), ADVICE)
    assert "truncated" in line
    proc = run("verify", pack, ok=False)
    bad = [x for x in proc.stdout.decode().splitlines() if x.startswith("CORRUPT")]
    assert bad and all(str(shard) in x and ADVICE in x for x in bad), proc.stdout
    with stagefs.open(pack) as fs, pytest.raises(CorruptShardError, match=ADVICE):
        fs.read("data/rand.bin")
    os.truncate(shard, 10)  # not even a header
    one_line_error(run("cat", pack, "data/rand.bin", ok=False), str(shard), "header", ADVICE)
    del src


def test_things_that_are_not_packs(tmp_path: Path) -> None:
    notes = tmp_path / "notes"  # a directory whose manifest is something else
    notes.mkdir()
    (notes / MANIFEST_NAME).write_bytes(b"a shopping list, not a manifest" * 4)
    short = tmp_path / "short"
    short.mkdir()
    (short / MANIFEST_NAME).write_bytes(b"tiny")
    for pack, why in ((notes, "not a stagefs manifest"), (short, "truncated manifest")):
        manifest = str(pack / MANIFEST_NAME)
        for args in (["info", pack], ["ls", pack], ["verify", pack]):
            one_line_error(run(*args, ok=False), manifest, why, ADVICE)
        with pytest.raises(CorruptManifestError, match=ADVICE):
            stagefs.open(pack)
    missing = tmp_path / "missing"
    one_line_error(run("info", missing, ok=False), str(missing), "no dataset here")
    with pytest.raises(FileNotFoundError):
        stagefs.open(missing)


def _serve(work: Path, pack: Path, tier: Path, rt: Path) -> subprocess.Popen[bytes]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (work / "hosts").write_text(f"127.0.0.1:{port}\n")
    run("serve", "--new-token", work / "token")
    cmd = [EXE or "stagefs", "serve", str(pack), "--tier", f"{tier}:256MiB",
           "--runtime", str(rt), "--hosts", str(work / "hosts"), "--rank", "0",
           "--token-file", str(work / "token"), "--progress", "0"]
    log = open(work / "serve.log", "ab")  # noqa: SIM115 - the child's; closed below
    try:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        log.close()


def test_clean_refuses_while_serve_runs_and_removes_its_tier_data_after(
        cli_pack: tuple[Path, Path], tmp_path: Path) -> None:
    import json
    import signal
    import time

    pack, tier, rt = cli_pack[1], tmp_path / "tier", tmp_path / "rt"
    daemon = _serve(tmp_path, pack, tier, rt)
    try:
        deadline = time.monotonic() + 90  # a bound on a wait, not a measurement
        while not (rt / "cluster.json").exists() or not json.loads(
                (rt / "cluster.json").read_text()).get("staged"):
            assert daemon.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.05)
        with stagefs.open(pack) as fs:
            data = tier / fs.manifest.pack_id.hex()
        assert os.listdir(data)
        line = one_line_error(run("clean", "--runtime", rt, ok=False), f"pid {daemon.pid}",
                              "serve", "--force")
        assert str(rt) in line and os.listdir(data)
    finally:
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(60)
    assert code == 0, (tmp_path / "serve.log").read_text()
    proc = run("clean", "--runtime", rt)
    assert f"removed {data}" in proc.stdout.decode()
    assert not data.exists() and not rt.exists()


# -- mistakes that used to pass silently: each is an error naming the path and what to do --


def test_a_tier_whose_parent_is_missing_is_an_error(cli_pack: tuple[Path, Path],
                                                    tmp_path: Path) -> None:
    pack, rt = cli_pack[1], tmp_path / "rt"
    typo = Path(f"/sratch-{os.getpid()}") / "me" / "tier"  # /scratch misspelt
    one_line_error(run("stage", pack, "--tier", typo, "--runtime", rt, "--no-progress",
                       ok=False), str(typo.parent.parent), "does not exist", "mkdir -p")
    assert not typo.parent.parent.exists()
    # deeper down (a job's own directory), missing parents are created, and it says so
    deep = tmp_path / "job" / "tier"
    proc = run("stage", pack, "--tier", deep, "--runtime", rt, "--no-progress")
    assert deep.is_dir() and "created its parent directories" in proc.stderr.decode()


def test_run_serves_a_program_that_is_not_python(cli_pack: tuple[Path, Path],
                                                tmp_path: Path) -> None:
    """The preload library serves ls; the directory on disk is said to be hidden
    (tests/integration/test_preload.py tests the programs themselves)."""
    from stagefs._native import preload_library

    if preload_library() is None:
        pytest.skip("the preload library is not built")
    src, pack = cli_pack
    at = tmp_path / "at"
    at.mkdir()  # empty on disk: ls would list nothing and exit 0
    for extra in ([], ["--any-program"]):  # --any-program: accepted, changes nothing
        proc = run("run", "--dataset", pack, "--at", at, *extra, "--", "ls", "-1", at)
        assert proc.stdout.decode().splitlines() == sorted(os.listdir(src))
        assert "staged view hides it" in proc.stderr.decode()


def test_mount_refuses_a_directory_that_holds_files(cli_pack: tuple[Path, Path],
                                                    tmp_path: Path) -> None:
    mp = tmp_path / "mp"
    mp.mkdir()
    (mp / "mine.txt").write_bytes(b"mine")
    try:
        one_line_error(run("mount", cli_pack[1], mp, ok=False), str(mp), "not empty",
                       "mine.txt", "--force-nonempty")
    finally:  # a regression mounts: leave no mount behind
        if is_mounted(str(mp)):
            run("umount", mp)
    assert os.listdir(mp) == ["mine.txt"]


@pytest.mark.skipif(fuse_available() is not None, reason=str(fuse_available()))
def test_mount_force_nonempty_hides_then_gives_back(cli_pack: tuple[Path, Path],
                                                    tmp_path: Path) -> None:
    src, pack = cli_pack
    mp = tmp_path / "mp"
    mp.mkdir()
    (mp / "mine.txt").write_bytes(b"mine")
    run("mount", pack, mp, "--force-nonempty")
    try:
        assert sorted(os.listdir(mp)) == sorted(os.listdir(src))
    finally:
        run("umount", mp)
    assert os.listdir(mp) == ["mine.txt"]


def test_pack_of_a_file_says_it_is_a_file(cli_pack: tuple[Path, Path], tmp_path: Path) -> None:
    f = cli_pack[0] / "a.txt"
    one_line_error(run("pack", f, tmp_path / "p", ok=False), str(f),
                   "is a file, not a directory", "stagefs pack SRC_DIR DEST")
    assert not (tmp_path / "p").exists()


def test_info_on_a_raw_directory_says_so(cli_pack: tuple[Path, Path], tmp_path: Path) -> None:
    src = cli_pack[0]
    proc = run("info", src, env={"STAGEFS_RUNTIME": str(tmp_path / "rt")})
    lines = proc.stdout.decode().splitlines()
    assert lines[0].startswith("raw directory") and str(src) in lines[0], lines
    assert "not a pack" in lines[0] and "in place" in lines[0]
    assert any(x.split() == ["files", "10"] for x in lines), lines
    assert not any(x.startswith(("pack ", "shards")) for x in lines), lines
    assert lines[-1].endswith(f"stagefs pack {src} DEST")


def test_serve_mpi_without_mpi4py_says_how_to_install(cli_pack: tuple[Path, Path],
                                                      tmp_path: Path) -> None:
    fake = tmp_path / "site" / "mpi4py"  # shadows the real one: as if it were not installed
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named mpi4py')\n")
    path = os.pathsep.join([str(fake.parent), os.environ.get("PYTHONPATH", "")])
    proc = run("serve", cli_pack[1], "--mpi", "--tier", tmp_path / "tier", "--runtime",
               tmp_path / "rt", ok=False, env={"PYTHONPATH": path})
    one_line_error(proc, "--mpi was given", "mpi4py", "pip install 'stagefs[mpi]'",
                   "--hosts FILE")


# -- stagefs doctor ------------------------------------------------------------------------

DOCTOR_CHECKS = ("FUSE: fusermount3", "FUSE: /dev/fuse", "FUSE: mfusepy", "/dev/shm",
                 "C accelerator", "MPI: mpi4py", "MPI: mpiexec", "Slurm: job", "Slurm: srun",
                 "page size", "memory", "network: socket send buffer", "open files")


def _doctor_rows(proc: subprocess.CompletedProcess[bytes]) -> dict[str, tuple[str, str]]:
    rows = {}
    for line in proc.stdout.decode().splitlines()[2:]:
        check, status, meaning = (c.strip() for c in line.strip("|").split("|"))
        rows[check] = (status, meaning)
    return rows


def test_doctor_prints_every_check_and_measures_a_tier(tmp_path: Path) -> None:
    good = tmp_path / "good"
    good.mkdir()
    rows = _doctor_rows(run("doctor", "--tier", f"{good}:2MiB", "--tier", tmp_path / "new"))
    for check in DOCTOR_CHECKS:
        assert check in rows and rows[check][0] in ("ok", "warn", "missing"), (check, rows)
    status, meaning = rows[f"tier {good}:2MiB"]
    assert status == "ok" and "free of" in meaning and meaning.count("MiB/s") == 2, meaning
    assert rows[f"tier {tmp_path / 'new'}"][0] == "ok"  # created on first use
    assert os.listdir(good) == [] and not (tmp_path / "new").exists()  # doctor changes nothing
    # the tiers of $STAGEFS_TIERS when no --tier is given
    rows = _doctor_rows(run("doctor", env={"STAGEFS_TIERS": str(good)}))
    assert rows[f"tier {good}"][0] == "ok"


def test_doctor_reports_a_tier_that_cannot_be_used(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    typo = Path(f"/sratch-{os.getpid()}") / "me" / "tier"  # /scratch misspelt
    proc = run("doctor", "--tier", blocker / "tier", "--tier", typo, ok=False)
    assert proc.returncode == 1 and b"Traceback" not in proc.stderr
    rows = _doctor_rows(proc)
    assert rows[f"tier {blocker / 'tier'}"] == (
        "error", f"tier {blocker / 'tier'}: {blocker} is a file, not a directory; "
                 "correct the path")
    status, meaning = rows[f"tier {typo}"]
    assert status == "error" and f"mkdir -p {typo.parent}" in meaning
    assert str(typo) in proc.stderr.decode()


def test_wait_staged_with_no_cluster_fails(tmp_path: Path) -> None:
    """`stagefs status --wait-staged` before any daemon wrote the runtime directory (it
    exists; daemons started with --wait write it once staged): not staged, exit 1, saying
    so (it printed a single node's table and exited 0)."""
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    r = subprocess.run([sys.executable, "-m", "stagefs.cli", "status", "--runtime", str(rt),
                        "--wait-staged", "0.5"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "no cluster daemon" in r.stderr and "not staged" in r.stderr
    # a --runtime that is not there: said as such (it named a job and $STAGEFS_JOB)
    r = subprocess.run([sys.executable, "-m", "stagefs.cli", "status", "--runtime",
                        str(tmp_path / "none")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "(--runtime)" in r.stderr and "STAGEFS_JOB" not in r.stderr


def test_wait_staged_ends_at_once_when_the_daemon_failed_or_ended(tmp_path: Path) -> None:
    """A daemon that fails at start (here a token file others can read) leaves its reason
    in its runtime directory: `stagefs status --wait-staged 600` ends at once with it,
    instead of waiting out its 600 s; and so for a daemon whose process is gone."""
    from stagefs.net import auth

    pack = tmp_path / "pack"
    src = tmp_path / "src"
    build_sample_tree(src)
    stagefs.pack(src, pack)
    token = tmp_path / "token"
    auth.write_token(str(token), auth.new_token())
    token.chmod(0o644)
    hosts = tmp_path / "hosts"
    with socket.socket() as s:  # a port of its own (it fails before it listens)
        s.bind(("127.0.0.1", 0))
        hosts.write_text(f"127.0.0.1:{s.getsockname()[1]}\n")
    rt = tmp_path / "rt"
    serve = subprocess.run([sys.executable, "-m", "stagefs.cli", "serve", str(pack), "--tier",
                            f"{tmp_path / 'tier'}:64MiB", "--runtime", str(rt), "--hosts",
                            str(hosts), "--rank", "0", "--token-file", str(token)],
                           capture_output=True, text=True, timeout=120)
    assert serve.returncode != 0 and "chmod 600" in serve.stderr, serve.stderr
    status = [sys.executable, "-m", "stagefs.cli", "status", "--runtime", str(rt),
              "--wait-staged", "600"]
    r = subprocess.run(status, capture_output=True, text=True, timeout=120)  # not 600 s
    assert r.returncode == 1 and "could not start" in r.stderr and "chmod 600" in r.stderr
    assert "Traceback" not in r.stderr
    # a daemon that took the directory and is gone (killed): said so too
    (rt / "daemon.failed").unlink()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (rt / "daemon.pid").write_text(gone + "\n")
    r = subprocess.run(status, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and f"pid {gone}" in r.stderr and "ended" in r.stderr


def test_output_cut_short_by_its_reader_is_not_success(tmp_path: Path) -> None:
    """`stagefs cat big | head -c 10`: the reader leaves, the command ends as a program
    killed by SIGPIPE does (141), so `set -o pipefail` does not take the cut for a success
    (`stagefs verify | head` once exited 0 whatever verify had found)."""
    if EXE is None:
        pytest.skip("the stagefs console script is not on PATH (pip install -e .)")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "big").write_bytes(os.urandom(4 << 20))
    run("pack", tmp_path / "src", tmp_path / "pack")
    with subprocess.Popen([EXE, "cat", str(tmp_path / "pack"), "big"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        assert len(proc.stdout.read(10)) == 10
        proc.stdout.close()
        err = proc.stderr.read()
        assert proc.wait(timeout=60) == 141, err
    assert b"Traceback" not in err and b"Exception ignored" not in err, err


def test_run_of_a_command_that_is_not_there_exits_as_a_shell_does(
        cli_pack: tuple[Path, Path], tmp_path: Path) -> None:
    """127 for a command not found, 126 for a file that is not executable (as a shell,
    env and timeout say it): a job script tells them from the program's own failure."""
    _, pack = cli_pack
    script = tmp_path / "train.sh"
    script.write_text("echo hi\n")  # not made executable
    for cmd, code, said in ((["no-such-command-here"], 127, "command not found"),
                            ([str(script)], 126, "not an executable file")):
        proc = run("run", "--dataset", pack, "--at", tmp_path / "at", "--", *cmd, ok=False)
        assert proc.returncode == code, proc.stderr
        assert proc.stderr.decode().strip() == f"stagefs run: {cmd[0]}: {said}"
