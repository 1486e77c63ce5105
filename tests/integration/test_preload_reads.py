"""How the preload library verifies what it reads: every read route (a unit wanted whole,
read straight into the caller's buffer; a unit wanted in part, verified whole in the
thread's buffer; reads that mix both, cross pieces or end at a short last piece) returns
exactly the plain file's bytes, a bad tier copy is never returned by any of them, and a
process verifies each piece (or small file) once."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_preload import BIG, _env, _tier_copy, plain, run

import stagefs
from conftest import flip_byte, random_bytes
from stagefs._native import preload_library
from tiers_helpers import compile_c

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(preload_library() is None,
                       reason="the preload library is not built (no C compiler at install)"),
]

MiB = 2**20
SMALL = "data/rand.bin"  # 200,000 bytes: no pieces, verified whole
BIG_SIZE = 3 * MiB + 4321

# probe FILE OP... : each OP is p:OFF:LEN (pread), r:LEN:COUNT (COUNT reads at the
# position), s:OFF (lseek), v:OFF:A,B,C (preadv of three buffers), or w (wait for a line on
# stdin); prints what each returned and an FNV hash of the bytes, or the errno and whether
# the buffer holds anything but zeros after a failed read
PROBE = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>
static unsigned char buf[8 << 20];
static uint64_t fnv(const unsigned char *p, size_t n) {
    uint64_t h = 14695981039346656037ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ULL;
    return h;
}
/* got bytes from buf, or a failed read of want bytes into buf + at */
static void show(const char *op, ssize_t got, size_t at, size_t want) {
    if (got >= 0) { printf("%s %zd %llx\n", op, got, (unsigned long long)fnv(buf, (size_t)got)); return; }
    int dirty = 0;
    for (size_t i = at; i < at + want; i++) dirty |= buf[i] != 0xAA && buf[i] != 0;
    printf("%s error %d dirty %d\n", op, errno, dirty);
}
int main(int argc, char **argv) {
    int fd = open(argv[1], O_RDONLY);
    if (fd < 0) { perror(argv[1]); return 2; }
    for (int i = 2; i < argc; i++) {
        const char *op = argv[i];
        long long a = 0, b = 0, c = 0, d = 0;
        memset(buf, 0xAA, sizeof buf);
        if (op[0] == 'p' && sscanf(op, "p:%lld:%lld", &a, &b) == 2) {
            show(op, pread(fd, buf, (size_t)b, (off_t)a), 0, (size_t)b);
        } else if (op[0] == 'r' && sscanf(op, "r:%lld:%lld", &a, &b) == 2) {
            size_t total = 0;
            ssize_t got = 0;
            for (long long k = 0; k < b; k++) {
                got = read(fd, buf + total, (size_t)a);
                if (got <= 0) break;
                total += (size_t)got;
            }
            show(op, got < 0 ? got : (ssize_t)total, total, (size_t)a);
        } else if (op[0] == 's' && sscanf(op, "s:%lld", &a) == 1) {
            printf("%s %lld\n", op, (long long)lseek(fd, (off_t)a, SEEK_SET));
        } else if (op[0] == 'v' && sscanf(op, "v:%lld:%lld,%lld,%lld", &a, &b, &c, &d) == 4) {
            struct iovec iov[3] = {{buf, (size_t)b}, {buf + b, (size_t)c}, {buf + b + c, (size_t)d}};
            show(op, preadv(fd, iov, 3, (off_t)a), 0, (size_t)(b + c + d));
        } else if (op[0] == 'w') {
            fflush(stdout);
            char line[16];
            if (!fgets(line, sizeof line, stdin)) return 3;
        } else {
            fprintf(stderr, "bad op %s\n", op);
            return 2;
        }
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_c(tmp_path_factory, "readprobe", PROBE)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(tree, pack): a file of three pieces and a short fourth, and a small file."""
    src = tmp_path_factory.mktemp("reads") / "src"
    (src / "data").mkdir(parents=True)
    (src / BIG).parent.mkdir(parents=True)
    (src / BIG).write_bytes(random_bytes(BIG_SIZE, 11))
    (src / SMALL).write_bytes(random_bytes(200_000, 12))
    pack = src.parent / "pack"
    stagefs.pack(str(src), str(pack), progress=False)
    with stagefs.open(pack) as fs:
        assert fs.manifest.piece_size == MiB
    return src, pack


# each list runs in a new process, so that every unit it reads is not verified yet
PATTERNS = {
    BIG: [
        ["p:0:8388608"],  # the whole file in one read: every piece straight into the buffer
        ["p:1048000:2000"],  # the end of piece 0 and the start of piece 1, both in part
        ["p:1000:3145000"],  # part of 0, pieces 1 and 2 whole, part of the short last one
        ["p:3145728:4321", "p:3145800:100000", "p:3150049:10", "p:9000000:10"],  # the end
        ["s:0", "r:131072:40"],  # cat: 128 KiB reads through the whole file
        ["s:1048570", "r:1:12", "r:4095:3"],  # byte reads across a piece's end
        ["p:1500000:10", "p:0:3000000"],  # piece 1 held in part, then a read through it
        ["p:2097152:1048576", "p:2097100:1048700"],  # piece 2 whole, then over its edges
        ["v:1048000:100,1048576,5000"],  # one preadv across three pieces
        ["s:3145000", "r:65536:3"],  # reads that run into the end of the file
    ],
    SMALL: [
        ["p:0:1048576"],  # the file whole, straight into the buffer
        ["s:0", "r:4096:60"],  # stdio-sized reads: the file verified whole once
        ["p:199990:100", "p:0:200000", "p:100:10"],
        ["v:7:10,150000,60000"],
    ],
}


@pytest.mark.parametrize("rel", sorted(PATTERNS))
def test_every_read_route_gives_the_plain_bytes(tree: tuple[Path, Path], tmp_path: Path,
                                                probe: Path, rel: str) -> None:
    src, pack = tree
    at = tmp_path / "data"
    for tiers in ([tmp_path / "tier"], []):  # the tier's copy; the origin's shard
        for ops in PATTERNS[rel]:
            got = run(pack, at, probe, at / rel, *ops, tiers=tiers)
            assert got.stdout == plain(probe, src / rel, *ops), (tiers, ops, got.stderr)
    assert b"error" not in plain(probe, src / BIG, *PATTERNS[BIG][3])


def _staged_tier(pack: Path, tmp_path: Path) -> Path:
    tier = tmp_path / "tier"
    subprocess.run([sys.executable, "-m", "stagefs.cli", "stage", str(pack), "--tier", str(tier),
                    "--runtime", str(tmp_path / "rt"), "--no-progress"], check=True, env=_env(),
                   capture_output=True, timeout=120)
    return tier


@pytest.mark.parametrize("ops", [["p:0:8388608"], ["s:0", "r:131072:40"], ["p:2097000:300"],
                                 ["v:2097152:100,1048576,5000"]])
def test_a_bad_tier_copy_is_never_returned(tree: tuple[Path, Path], tmp_path: Path,
                                           probe: Path, ops: list[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """One byte of piece 2 flipped in the tier's copy: whichever way the read meets it, the
    program gets the origin's bytes; flipped in the origin too, an error and a buffer that
    holds none of the bad copy."""
    src, orig = tree
    pack = tmp_path / "pack"
    shutil.copytree(orig, pack)
    tier = _staged_tier(pack, tmp_path)
    monkeypatch.setenv("STAGEFS_RUNTIME", str(tmp_path / "rt"))
    copy, off = _tier_copy(tier, pack, BIG)
    flip_byte(copy, off + 2 * MiB + 12345)
    at = tmp_path / "data"
    got = run(pack, at, probe, at / BIG, *ops, tiers=[tier])
    assert got.stdout == plain(probe, src / BIG, *ops), got.stderr
    flip_byte(pack / copy.name, off + 2 * MiB + 12345)
    got = run(pack, at, probe, at / BIG, *ops)  # no tier: the origin's bad shard only
    last = got.stdout.decode().splitlines()[-1]
    assert last.endswith("error 5 dirty 0"), got.stdout  # EIO, nothing of the bad bytes


def test_a_process_verifies_a_copy_once(tree: tuple[Path, Path], tmp_path: Path, probe: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Tier copies are written once and renamed into place, never changed (0014): a process
    hashes each piece and small file once, and reads it again without hashing. So a copy
    changed in place after a process verified it is not noticed by that process; every
    process started after it notices, and reads the origin's bytes instead."""
    src, orig = tree
    pack = tmp_path / "pack"
    shutil.copytree(orig, pack)
    tier = _staged_tier(pack, tmp_path)
    monkeypatch.setenv("STAGEFS_RUNTIME", str(tmp_path / "rt"))
    copy, off = _tier_copy(tier, pack, SMALL)
    at = tmp_path / "data"
    ops = ["p:0:1048576", "w", "p:0:1048576"]
    want = plain(probe, src / SMALL, "p:0:1048576").decode()
    argv = [sys.executable, "-m", "stagefs.cli", "run", "--dataset", str(pack), "--at", str(at),
            "--tier", str(tier), "--", str(probe), str(at / SMALL), *ops]
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_env()) as p:
        assert p.stdout is not None and p.stdin is not None
        assert p.stdout.readline().decode() == want  # verified, then waits
        flip_byte(copy, off + 777)
        p.stdin.write(b"go\n")
        p.stdin.flush()
        second = p.stdout.readline().decode()
        assert p.wait(timeout=60) == 0
    assert second != want  # read again without a second hash: the changed byte
    got = run(pack, at, probe, at / SMALL, "p:0:1048576", tiers=[tier])
    assert got.stdout.decode() == want  # a new process hashes it, and reads the origin


# a program under `stagefs run` that opens FILE, prints what its descriptor is (asked of a
# process without the library, which would show the staged path), then OFF bytes in
WHERE = ("import os, subprocess, sys\n"
         "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
         "env = {k: v for k, v in os.environ.items() if k != 'LD_PRELOAD'}\n"
         "print(subprocess.run(['readlink', f'/proc/{os.getpid()}/fd/{fd}'], env=env,\n"
         "                     capture_output=True, text=True, check=True).stdout.strip())\n"
         "print(os.pread(fd, 64, int(sys.argv[2])).hex())\n")


def _huge_pack(tmp_path: Path, seed: int, align: int | None = None) -> tuple[Path, bytes]:
    """A pack of one file over the 64 MiB the helper copies whole (huge.bin), and its bytes
    (``align``: the pack's, else the default)."""
    src = tmp_path / "src"
    src.mkdir()
    data = random_bytes(65 * MiB + 4321, seed)
    (src / "huge.bin").write_bytes(data)
    stagefs.pack(str(src), str(tmp_path / "pack"), progress=False,
                 **({} if align is None else {"align": align}))
    return tmp_path / "pack", data


def test_a_huge_file_held_in_part_is_not_copied_whole(tmp_path: Path) -> None:
    """A file larger than the helper copies whole (64 MiB), its shard held in part by a tier:
    the program's descriptor is the origin's shard (its pieces read through the helper). It
    was handed a memfd of the whole file, read through the Store at each open (a 1.1 GB
    file: 1.1 GB of memory and 5 s per open, for a read of 10 bytes)."""
    pack, data = _huge_pack(tmp_path, 21)
    at, off = tmp_path / "data", 40 * MiB - 10
    got = run(pack, at, sys.executable, "-c", WHERE, at / "huge.bin", str(off),
              tiers=[Path(f"{tmp_path / 'tier'}:8MiB")])
    link, read = got.stdout.decode().splitlines()
    assert read == data[off:off + 64].hex()
    assert Path(link).name == "shard-000000.sfs", link  # not /memfd:stagefs:huge.bin


def _origin_bytes(log: Path, pack: Path) -> int:
    """The bytes an ``strace -f -y`` log shows read from the pack's shard files."""
    start = re.compile(r"^(\d+) +\w+\((\d+)<([^>]*)>")
    resumed = re.compile(r"^(\d+) +<\.\.\. \w+ resumed>")
    ret = re.compile(r"= (\d+)\s*$")
    pending: dict[str, str] = {}
    total = 0
    for line in log.read_text(errors="replace").splitlines():
        path = None
        if m := start.match(line):
            if line.endswith("<unfinished ...>"):
                pending[m[1]] = m[3]
                continue
            path = m[3]
        elif m := resumed.match(line):
            path = pending.pop(m[1], None)
        if path and path.startswith(f"{pack}/shard-") and (r := ret.search(line)):
            total += int(r[1])
    return total


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
@pytest.mark.parametrize("layout", ["split", "part"])
def test_a_huge_file_held_in_tiers_is_read_from_them(tmp_path: Path, layout: str) -> None:
    """A file over 64 MiB, its shard not whole in one tier: held whole across a memory tier
    smaller than the shard and a disk tier ("split"), or in part by one tier ("part"). The
    first run reads each origin byte once, and a later run reads from the origin only the
    pieces no tier holds. The library read such a file from the origin's shard itself: every
    run read the whole file from the origin, and the first read it twice (once more for the
    tiers). Counted on every process of the run (the helper's too), by strace."""
    pack, data = _huge_pack(tmp_path, 23)
    at = tmp_path / "data"
    tiers = [f"{tmp_path / 't0'}:8MiB"] + ([str(tmp_path / "t1")] if layout == "split" else [])
    argv = [sys.executable, "-m", "stagefs.cli", "run", "--dataset", str(pack), "--at", str(at)]
    for t in tiers:
        argv += ["--tier", t]
    fetched = []
    for n in range(2):
        log = tmp_path / f"reads{n}.log"
        got = subprocess.run(["strace", "-f", "-qq", "-y", "-o", str(log), "-e",
                              "trace=read,pread64,readv,preadv,preadv2,copy_file_range,sendfile",
                              *argv, "--", "md5sum", str(at / "huge.bin")],
                             capture_output=True, timeout=300, env=_env(), check=False)
        assert got.returncode == 0, got.stderr.decode()
        assert got.stdout.split()[0].decode() == hashlib.md5(data).hexdigest()
        fetched.append(_origin_bytes(log, pack))
    shard = (pack / "shard-000000.sfs").stat().st_size
    assert len(data) <= fetched[0] <= shard, fetched  # each byte once
    held = 0 if layout == "split" else len(data) - 8 * MiB  # the 8 MiB tier holds 8 pieces
    assert abs(fetched[1] - held) <= MiB, fetched


MAP_MD5 = ("import hashlib, mmap, sys\n"
           "with open(sys.argv[1], 'rb') as f:\n"
           "    m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n"
           "    print(hashlib.md5(m).hexdigest())\n")


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
@pytest.mark.parametrize("align", [None, 1])
def test_a_huge_file_held_in_part_is_mapped_from_the_tier(tmp_path: Path,
                                                          align: int | None) -> None:
    """A file over 64 MiB whose shard a tier holds in part, mapped (np.load(mmap_mode="r")
    of a large array): the pieces the tier holds are mapped from its copy, only the others
    read from the origin. The mapping was the origin's shard whole: every epoch read the
    whole file from the origin whatever the tier held (90 MB of a 90 MB file with 49 MiB
    of it in the tier), and its sample was counted nowhere. Not page aligned in its shard
    (``--align 1``), the file is a private copy of the pieces the helper reads (the tier's
    or the origin's): each piece no tier held was read from the origin twice. A held piece
    whose bytes are bad is read from the origin, and counted as a failed check."""
    pack, data = _huge_pack(tmp_path, 25, align)
    at, rt = tmp_path / "data", tmp_path / "rt"
    argv = [sys.executable, "-m", "stagefs.cli", "run", "--dataset", str(pack), "--at", str(at),
            "--tier", f"{tmp_path / 't0'}:8MiB"]
    env = dict(_env(), STAGEFS_RUNTIME=str(rt))
    fetched = []
    for n in range(2):
        log = tmp_path / f"maps{n}.log"
        got = subprocess.run(["strace", "-f", "-qq", "-y", "-o", str(log), "-e",
                              "trace=read,pread64,readv,preadv,preadv2,copy_file_range,sendfile",
                              *argv, "--", sys.executable, "-c", MAP_MD5, str(at / "huge.bin")],
                             capture_output=True, timeout=300, env=env, check=False)
        assert got.returncode == 0, got.stderr.decode()
        assert got.stdout.split()[0].decode() == hashlib.md5(data).hexdigest()
        fetched.append(_origin_bytes(log, pack))
    assert abs(fetched[1] - (len(data) - 8 * MiB)) <= MiB, fetched  # 8 pieces in the tier
    status = subprocess.run([sys.executable, "-m", "stagefs.cli", "status", "--json"],
                            capture_output=True, timeout=60, env=env, check=True)
    reads = json.loads(status.stdout)
    assert reads["reads"] == 2, reads  # a sample for each mapping
    assert reads["holders"]["disk"]["bytes"] >= 7 * MiB, reads["holders"]  # the tier's pieces
    copy, off = _tier_copy(tmp_path / "t0", pack, "huge.bin")
    flip_byte(f"{copy}.partial", off + 5)  # piece 0, held in the tier
    got = subprocess.run([*argv, "--", sys.executable, "-c", MAP_MD5, str(at / "huge.bin")],
                         capture_output=True, timeout=300, env=env, check=False)
    assert got.returncode == 0, got.stderr.decode()
    assert got.stdout.split()[0].decode() == hashlib.md5(data).hexdigest()
    status = subprocess.run([sys.executable, "-m", "stagefs.cli", "status", "--json"],
                            capture_output=True, timeout=60, env=env, check=True)
    assert json.loads(status.stdout)["checksum_failures"] == 1
