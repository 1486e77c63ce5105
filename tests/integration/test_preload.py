"""`stagefs run` with the preload library: real programs (coreutils, a shell, a C program
compiled here, Python with numpy) read a packed tree at --at, and must see exactly what they
see in the same tree read plainly."""

from __future__ import annotations

import contextlib
import hashlib
import os
import select
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import stagefs
from conftest import build_sample_tree, flip_byte, random_bytes, text_bytes
from stagefs._native import preload_library
from tiers_helpers import compile_c

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(preload_library() is None,
                       reason="the preload library is not built (no C compiler at install)"),
]

SRC = Path(__file__).resolve().parents[2] / "src"
BIG = "big/pieces.bin"  # larger than a piece: read and verified piece by piece


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get(
        "PYTHONPATH", "")]).rstrip(os.pathsep), STAGEFS_TIERS="")


def run(pack: Path, at: Path, *cmd: str | Path, tiers: list[Path] = (),  # type: ignore[assignment]
        ok: bool = True) -> subprocess.CompletedProcess[bytes]:
    argv = [sys.executable, "-m", "stagefs.cli", "run", "--dataset", str(pack), "--at", str(at)]
    for t in tiers:
        argv += ["--tier", str(t)]
    proc = subprocess.run([*argv, "--", *map(str, cmd)], capture_output=True, timeout=120,
                          env=_env(), check=False)
    if ok:
        assert proc.returncode == 0, proc.stderr.decode()
    return proc


def plain(*cmd: str | Path, cwd: Path | None = None) -> bytes:
    return subprocess.run(list(map(str, cmd)), capture_output=True, check=True, cwd=cwd,
                          timeout=60).stdout


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(tree, pack): the sample tree plus a file of several pieces and a compressible one."""
    base = tmp_path_factory.mktemp("preload")
    src = build_sample_tree(base / "src")
    (src / "big").mkdir()
    (src / BIG).write_bytes(random_bytes(3 * 2**20 + 4321, 7))
    (src / "big/text.log").write_bytes(text_bytes(300_000, 8))  # stored zstd: the helper
    np.save(src / "big/noise.npy", np.random.default_rng(9).integers(0, 2**63, 300_000))  # raw
    os.utime(src / "big", ns=(10**18, 10**18))
    pack = base / "pack"
    stagefs.pack(str(src), str(pack))
    return src, pack


def _sh(at: Path, script: str) -> list[str]:
    return ["sh", "-c", f"cd '{at}' && {script}"]


def _no_dir_sizes(listing: bytes) -> list[str]:
    """ls -l lines without the totals and directories' sizes (a directory's size is its
    file system's business; stagefs says 0)."""
    out = []
    for line in listing.decode().splitlines():
        if line.startswith("total "):
            continue
        if line.startswith("d"):
            f = line.split()
            line = " ".join(f[:4] + f[5:])
        out.append(line)
    return out


def test_coreutils_see_the_plain_tree(packed: tuple[Path, Path], tmp_path: Path) -> None:
    src, pack = packed
    at = tmp_path / "data"
    files = sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file())
    # cat of every file (symlinks followed), byte for byte
    for rel in [*files, Path("link_chain"), Path("img/up")]:
        assert run(pack, at, "cat", at / rel).stdout == (src / rel).read_bytes(), rel
    script = "find . -type f | sort | xargs -d '\\n' md5sum"
    assert run(pack, at, *_sh(at, script)).stdout == plain(*_sh(src, script))
    script = "tar --sort=name -cf - ."
    assert run(pack, at, *_sh(at, script)).stdout == plain(*_sh(src, script))
    script = "find . -printf '%p %y %m %s %T@ %l\\n' | sort"
    got = run(pack, at, *_sh(at, script)).stdout.decode().splitlines()
    want = plain(*_sh(src, script)).decode().splitlines()
    # a directory's size is the file system's own: compare the rest
    strip = [" ".join(x for i, x in enumerate(line.split(" ")) if not (
        line.split(" ")[1] == "d" and i == 3)) for line in want]
    assert [" ".join(x for i, x in enumerate(line.split(" ")) if not (
        line.split(" ")[1] == "d" and i == 3)) for line in got] == strip
    script = "ls -lR --time-style=full-iso ."
    assert _no_dir_sizes(run(pack, at, *_sh(at, script)).stdout) == \
        _no_dir_sizes(plain(*_sh(src, script)))
    script = "find . -type f | sort | xargs -d '\\n' du -b --apparent-size; " \
             "find . -type f | sort | xargs -d '\\n' wc"
    assert run(pack, at, *_sh(at, script)).stdout == plain(*_sh(src, script))


def test_the_preferred_io_size_is_a_piece_for_a_file_of_pieces(packed: tuple[Path, Path],
                                                               tmp_path: Path) -> None:
    """st_blksize of a file larger than a piece is the piece size (cat then reads whole
    pieces, verified in its own buffer), 64 KiB for a smaller file; the preload library,
    the C index and the Python namespace say the same."""
    src, pack = packed
    at = tmp_path / "data"
    small = next(str(p.relative_to(src)) for p in sorted(src.rglob("*.jpg")))
    got = run(pack, at, "stat", "-c", "%o", at / BIG, at / small).stdout.split()
    with stagefs.open(pack) as fs:
        ns = fs.namespace
        piece = fs.manifest.piece_size
        assert piece and (src / BIG).stat().st_size > piece >= (src / small).stat().st_size
        want = [ns.blksize((src / r).stat().st_size) for r in (BIG, small)]
        assert want == [piece, 65536]
        assert [int(x) for x in got] == want
        assert [ns.stat(r).st_blksize for r in (BIG, small)] == want
        assert [ns.stat_entry(ns.entry(r)).st_blksize for r in (BIG, small)] == want


def test_a_shell_works_inside_the_tree(packed: tuple[Path, Path], tmp_path: Path) -> None:
    src, pack = packed
    at = tmp_path / "data"
    script = ("cd data && pwd -P && cat nested/deep/x && md5sum ../a.txt rand.bin && ls && "
              "cd nested && cat ../../img/cat.jpg | md5sum && cd ../../link_dir && ls -a && "
              "pwd -P && sh -c 'cat ../we*name.txt; pwd' && cat < ../a.txt | md5sum && "
              "exec 3< ../data/rand.bin && head -c 1000 <&3 | md5sum && md5sum <&3")
    got = run(pack, at, *_sh(at, script)).stdout.decode()
    want = plain(*_sh(src, script)).decode()
    assert got == want.replace(str(src), str(at))


C_PROBE = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

static uint64_t fnv(const unsigned char *p, size_t n, uint64_t h) {
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ULL;
    return h;
}
static int big_fd;
static void on_alarm(int sig) { (void)sig; }
static uint64_t sums[4];
static void *reader(void *arg) {
    long t = (long)arg;
    unsigned char buf[70000];
    uint64_t h = 14695981039346656037ULL;
    for (long i = 0; i < 60; i++) {
        off_t off = (off_t)((t * 7919 + i * 104729) % 3100000);
        ssize_t got = pread(big_fd, buf, sizeof buf - (size_t)(i * 13), off);
        if (got < 0) { perror("pread"); exit(3); }
        h = fnv(buf, (size_t)got, h);
    }
    sums[t] = h;
    return NULL;
}
int main(int argc, char **argv) {
    const char *big = argv[1], *small = argv[2], *outside = argv[3];
    unsigned char buf[1 << 16];
    /* threads pread one descriptor */
    big_fd = open(big, O_RDONLY);
    pthread_t th[4];
    for (long t = 0; t < 4; t++) pthread_create(&th[t], NULL, reader, (void *)t);
    for (int t = 0; t < 4; t++) pthread_join(th[t], NULL);
    printf("threads %llx %llx %llx %llx\n", (unsigned long long)sums[0],
           (unsigned long long)sums[1], (unsigned long long)sums[2], (unsigned long long)sums[3]);
    /* mmap: the whole file, and a window at a page offset */
    struct stat st;
    fstat(big_fd, &st);
    unsigned char *m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, big_fd, 0);
    unsigned char *w = mmap(NULL, 10000, PROT_READ, MAP_PRIVATE, big_fd, 4096 * 3);
    if (m == MAP_FAILED || w == MAP_FAILED) { perror("mmap"); return 4; }
    printf("mmap %lld %llx %llx\n", (long long)st.st_size,
           (unsigned long long)fnv(m, (size_t)st.st_size, 0), (unsigned long long)fnv(w, 10000, 0));
    /* the last page past the end of the file reads as zeros */
    size_t tail = (size_t)st.st_size % 4096, page = (size_t)st.st_size - tail;
    unsigned char *t = mmap(NULL, 4096, PROT_READ, MAP_SHARED, big_fd, (off_t)page);
    int zeros = 1;
    for (size_t i = tail; i < 4096; i++) zeros &= t[i] == 0;
    printf("tail %d %llx\n", zeros, (unsigned long long)fnv(t, tail, 0));
    /* fork between open and read: the child reads half, the parent goes on from there */
    int fd = open(small, O_RDONLY);
    pid_t pid = fork();
    if (pid == 0) { ssize_t got = read(fd, buf, 1000); printf("child %zd %llx\n", got, (unsigned long long)fnv(buf, (size_t)got, 0)); fflush(stdout); _exit(0); }
    waitpid(pid, NULL, 0);
    ssize_t got = read(fd, buf, sizeof buf);
    printf("parent %zd %llx\n", got, (unsigned long long)fnv(buf, (size_t)got, 0));
    /* dup2 shares the position; lseek through one, read through the other */
    dup2(fd, 20);
    lseek(fd, 17, SEEK_SET);
    got = read(20, buf, 100);
    printf("dup2 %zd %llx %lld\n", got, (unsigned long long)fnv(buf, (size_t)got, 0), (long long)lseek(fd, 0, SEEK_CUR));
    int d = fcntl(fd, F_DUPFD_CLOEXEC, 30);
    got = pread(d, buf, 50, 3);
    printf("dupfd %d %zd %llx\n", d >= 30, got, (unsigned long long)fnv(buf, (size_t)got, 0));
    /* a descriptor closed behind the library's back and reused for a real file */
    int n = open(small, O_RDONLY);
    syscall(SYS_close, n);
    int r = open(outside, O_RDONLY);
    got = read(r, buf, sizeof buf);
    printf("reuse %d %zd %llx\n", r == n, got, (unsigned long long)fnv(buf, (size_t)got, 0));
    /* signals arriving all through a read loop (no SA_RESTART) */
    struct sigaction sa = {.sa_handler = on_alarm};
    sigaction(SIGALRM, &sa, NULL);
    struct itimerval it = {{0, 200}, {0, 200}};
    setitimer(ITIMER_REAL, &it, NULL);
    uint64_t h = 0;
    size_t total = 0;
    lseek(big_fd, 0, SEEK_SET);
    for (;;) {
        ssize_t k = read(big_fd, buf, 4096);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) break;
        h = fnv(buf, (size_t)k, h);
        total += (size_t)k;
    }
    struct itimerval off = {{0, 0}, {0, 0}};
    setitimer(ITIMER_REAL, &off, NULL);
    printf("signals %zu %llx\n", total, (unsigned long long)h);
    /* stdio */
    FILE *f = fopen(small, "r");
    size_t nr = fread(buf, 1, sizeof buf, f);
    struct stat fs;
    fstat(fileno(f), &fs);
    printf("fopen %zu %lld %llx\n", nr, (long long)fs.st_size, (unsigned long long)fnv(buf, nr, 0));
    fclose(f);
    return 0;
}
"""


@pytest.fixture(scope="module")
def c_probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_c(tmp_path_factory, "cprobe", C_PROBE, "-pthread")


def test_a_c_program_threads_fork_dup_reuse_mmap(packed: tuple[Path, Path], tmp_path: Path,
                                                 c_probe: Path) -> None:
    src, pack = packed
    at = tmp_path / "data"
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"a real file, not staged\n" * 10)
    want = plain(c_probe, src / BIG, src / "data/rand.bin", outside)
    for tiers in ([], [tmp_path / "tier"]):
        got = run(pack, at, c_probe, at / BIG, at / "data/rand.bin", outside, tiers=tiers)
        assert got.stdout == want, (tiers, got.stderr.decode())
    assert b"reuse 1 240" in want and b"tail 1" in want  # the probe tests what it says


# A handler that reads a staged file, run at random points of a loop that opens, reads and
# closes staged files (another thread sends the signals as fast as it can): the handler's
# read may interrupt the library anywhere, in the middle of its own bookkeeping of
# descriptors included. Prints the signals handled, the loop's rounds and byte total, an FNV
# hash of the loop's bytes, and how many of the handler's reads differed from the file.
SIGNAL_PROBE = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
static int hfd;
static unsigned char want[3000];
static volatile sig_atomic_t handled, bad;
static volatile int done;
static pthread_t main_thread;
static void on_signal(int s) {
    (void)s;
    int saved = errno;
    unsigned char b[sizeof want];
    if (pread(hfd, b, sizeof b, 100) != (ssize_t)sizeof b || memcmp(b, want, sizeof b)) bad++;
    handled++;
    errno = saved;
}
static void *pester(void *arg) {
    (void)arg;
    while (!done) pthread_kill(main_thread, SIGUSR1);
    return NULL;
}
int main(int argc, char **argv) {
    hfd = open(argv[1], O_RDONLY);
    if (hfd < 0 || pread(hfd, want, sizeof want, 100) != (ssize_t)sizeof want) return 2;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART;
    sigaction(SIGUSR1, &sa, NULL);
    main_thread = pthread_self();
    pthread_t t;
    pthread_create(&t, NULL, pester, NULL);
    long rounds = atol(argv[3]);
    uint64_t h = 14695981039346656037ULL, total = 0;
    static unsigned char buf[8192];
    for (long i = 0; i < rounds; i++) {
        int fd = open(argv[2], O_RDONLY);
        if (fd < 0) { perror(argv[2]); return 3; }
        for (;;) {
            ssize_t n = read(fd, buf, sizeof buf);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) break;
            total += (uint64_t)n;
            for (ssize_t k = 0; k < n; k++) h = (h ^ buf[k]) * 1099511628211ULL;
        }
        close(fd);
    }
    done = 1;
    pthread_join(t, NULL);
    printf("%ld %ld %llu %llx %d\n", (long)handled, rounds, (unsigned long long)total,
           (unsigned long long)h, (int)bad);
    return 0;
}
"""


@pytest.fixture(scope="module")
def signal_probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_c(tmp_path_factory, "sigprobe", SIGNAL_PROBE, "-pthread")


def test_a_signal_handler_reads_a_staged_file_mid_read(packed: tuple[Path, Path],
                                                       tmp_path: Path, signal_probe: Path) -> None:
    """A handler's staged read interrupting the library in an open, a read or a close
    neither waits forever (the descriptor table took a lock a handler could wait on) nor
    gets or gives wrong bytes."""
    src, pack = packed
    at = tmp_path / "data"
    # 1,000 rounds: the handler runs millions of times (a signal storm costs each round
    # tens of ms here under the library, a few without it); 8,000 outran the timeout
    want = plain(signal_probe, src / "data/rand.bin", src / "a.txt", 1000).split()
    got = run(pack, at, signal_probe, at / "data/rand.bin", at / "a.txt", 1000,
              tiers=[tmp_path / "tier"]).stdout.split()
    assert int(got[0]) > 1000  # the handler ran, often, at random points of the loop
    assert got[1:] == want[1:]  # the loop's bytes; no handler read differed
    assert want[4] == b"0"


def test_writes_under_the_path_fail_and_change_nothing(packed: tuple[Path, Path],
                                                       tmp_path: Path) -> None:
    src, pack = packed
    at = tmp_path / "data"
    before = {p: p.read_bytes() for p in pack.iterdir()}
    for cmd in (f"echo x > '{at}/a.txt'", f"echo x >> '{at}/a.txt'", f"touch '{at}/new'",
                f"rm '{at}/a.txt'", f"mv '{at}/a.txt' '{at}/b.txt'",
                f"mv '{at}/a.txt' '{tmp_path}/moved'", f"mkdir '{at}/d'", f"rmdir '{at}/emptydir'",
                f"truncate -s 0 '{at}/a.txt'", f"chmod 777 '{at}/a.txt'",
                f"ln -s x '{at}/l'", f"ln '{at}/a.txt' '{tmp_path}/hard'",
                f"cp '{tmp_path}/../outside' '{at}/' 2>&1 || cp /etc/hostname '{at}/c'"):
        proc = run(pack, at, "sh", "-c", cmd, ok=False)
        assert proc.returncode != 0, cmd
        assert b"Read-only file system" in proc.stderr, (cmd, proc.stderr)
    assert {p: p.read_bytes() for p in pack.iterdir()} == before
    assert not (tmp_path / "moved").exists() and not (tmp_path / "hard").exists()
    assert run(pack, at, "cat", at / "a.txt").stdout == (src / "a.txt").read_bytes()


def test_dotdot_climbs_out_as_the_kernel_resolves(packed: tuple[Path, Path],
                                                  tmp_path: Path) -> None:
    src, pack = packed
    at = tmp_path / "data"  # does not exist on disk: only the staged view has it
    (tmp_path / "outside.txt").write_bytes(b"outside\n")
    got = run(pack, at, "sh", "-c", f"cat '{at}/../outside.txt' '{at}/img/../../outside.txt'; "
              f"cd '{at}/data' && cat ../../outside.txt && ls '{at}/link_dir/..' && "
              f"readlink -f '{at}/link_dir/../data/../img/up'")
    assert got.stdout.decode().splitlines() == [
        "outside", "outside", "outside", *sorted(os.listdir(src), key=lambda n: n.encode()),
        str(at / "data/arr.npy")]


def test_writes_through_dotdot_act_on_the_real_path(packed: tuple[Path, Path],
                                                    tmp_path: Path) -> None:
    """A write call whose path leaves --at through ".." acts on the real path it names (the
    kernel, to whom --at does not exist, would say ENOENT), as reads and xattr calls do."""
    _, pack = packed
    at = tmp_path / "data"  # does not exist on disk
    out = tmp_path / "out"
    out.mkdir()
    (out / "f").write_bytes(b"x")
    up = f"{at}/data/../../out"  # in the tree, then out of it
    script = (f"mkdir '{up}/d' && chmod 600 '{at}/../out/f' && ln -s f '{up}/l' && "
              f"ln '{up}/f' '{up}/h' && mv '{up}/h' '{at}/../out/h2' && truncate -s 5 '{up}/h2' "
              f"&& touch -d @1000000000 '{up}/f' && cd '{at}/data' && mkdir ../../out/rel && "
              f"rmdir ../../out/rel && rm ../../out/l && "
              f"{sys.executable} -c 'import os; os.remove(\"../../out/h2\")' && echo done")
    got = run(pack, at, "sh", "-c", script, ok=False)
    assert got.stdout == b"done\n", got.stderr.decode()
    assert sorted(os.listdir(out)) == ["d", "f"]
    assert (out / "f").stat().st_mode & 0o777 == 0o600
    assert (out / "f").stat().st_mtime == 1000000000
    # and a path that stays in the tree is still refused
    proc = run(pack, at, "sh", "-c", f"mkdir '{at}/data/../new'", ok=False)
    assert proc.returncode != 0 and b"Read-only file system" in proc.stderr


def test_a_relative_path_from_above_enters_the_tree(packed: tuple[Path, Path],
                                                    tmp_path: Path) -> None:
    """`cd /data; cat train/x` with --at /data/train: the relative path is served, also when
    --at exists on disk with other files (which it hides)."""
    src, pack = packed
    at = tmp_path / "up" / "data"
    at.mkdir(parents=True)
    (at / "a.txt").write_bytes(b"the file on disk, hidden\n")
    script = ("cd up && cat data/a.txt && ls data && cd / && cat "
              f"'{str(at / 'data/rand.bin').lstrip('/')}' | md5sum && cd '{tmp_path}/up/data/..' "
              "&& cat ./data/../data/a.txt")
    got = run(pack, at, "sh", "-c", f"cd '{tmp_path}' && {script}").stdout
    a = (src / "a.txt").read_bytes()
    listing = "".join(n + "\n" for n in sorted(os.listdir(src), key=lambda n: n.encode()))
    md5 = hashlib.md5((src / "data/rand.bin").read_bytes()).hexdigest()
    assert got.decode() == a.decode() + listing + f"{md5}  -\n" + a.decode()


def test_a_real_symlink_into_the_tree_is_followed(packed: tuple[Path, Path],
                                                  tmp_path: Path) -> None:
    """~/data -> /lustre/me/imagenet with --at /lustre/me/imagenet (not on disk): paths
    through the link, absolute, relative or a link to a file, are served as the kernel
    would resolve them, by C programs and Python alike."""
    src, pack = packed
    at = tmp_path / "imagenet"  # does not exist on disk
    (tmp_path / "home").mkdir()
    os.symlink(at, tmp_path / "home" / "data")
    os.symlink(at / "img" / "cat.jpg", tmp_path / "home" / "cat")
    os.symlink("home/data/img", tmp_path / "rel")  # relative, through the other link
    md5 = hashlib.md5((src / "data/rand.bin").read_bytes()).hexdigest()
    script = (f"cd '{tmp_path}/home' && md5sum data/data/rand.bin && cat cat | wc -c && "
              f"ls data/img/ && stat -L -c %s ../rel/dog.jpg && cd data/data && "
              f"md5sum rand.bin && readlink -f '{tmp_path}/rel/up' && "
              f"{sys.executable} -c 'import os; print(sorted(os.listdir(\"{tmp_path}/rel\")))'"
              f" && cat '{tmp_path}/home/data/nope'")
    got = run(pack, at, "sh", "-c", script, ok=False)
    img = sorted(os.listdir(src / "img"))
    assert got.stdout.decode().splitlines() == [
        f"{md5}  data/data/rand.bin", str((src / "img/cat.jpg").stat().st_size), *img,
        str((src / "img/dog.jpg").stat().st_size), f"{md5}  rand.bin",
        str(at / "data/arr.npy"), str(img)], got.stderr.decode()
    assert got.returncode != 0 and b"No such file or directory" in got.stderr


def _tier_copy(tier: Path, pack: Path, rel: str) -> tuple[Path, int]:
    """The tier's copy of the shard holding ``rel``, and the file's offset in it."""
    with stagefs.open(pack) as fs:
        m = fs.manifest
        e = fs.namespace.file_entry(rel)
        return tier / m.pack_id.hex() / m.shards[m.shard[e]].name, int(m.offset[e])



def test_a_corrupt_copy_never_gives_wrong_bytes(packed: tuple[Path, Path], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    src, orig = packed
    pack = tmp_path / "pack"
    shutil.copytree(orig, pack)
    at, tier = tmp_path / "data", tmp_path / "tier"
    rt = tmp_path / "rt"
    subprocess.run([sys.executable, "-m", "stagefs.cli", "stage", str(pack), "--tier",
                    str(tier), "--runtime", str(rt), "--no-progress"], check=True, env=_env(),
                   capture_output=True, timeout=120)
    monkeypatch.setenv("STAGEFS_RUNTIME", str(rt))
    copy, off = _tier_copy(tier, pack, "data/rand.bin")
    assert copy.is_file()
    flip_byte(copy, off + 1000)
    want = hashlib.md5((src / "data/rand.bin").read_bytes()).hexdigest()
    # the tier's copy is bad: the origin's bytes are read instead
    got = run(pack, at, "md5sum", at / "data/rand.bin", tiers=[tier])
    assert got.stdout.decode().split()[0] == want, got.stderr.decode()
    # bad in the origin, read with no tier: an error, never bytes
    flip_byte(pack / copy.name, off + 1000)
    got = run(pack, at, "cat", at / "data/rand.bin", ok=False)
    assert got.returncode != 0 and b"Input/output error" in got.stderr
    assert got.stdout == b""


def test_python_mmap_gets_the_library_s_descriptor(packed: tuple[Path, Path],
                                                   tmp_path: Path) -> None:
    src, pack = packed
    at = tmp_path / "data"
    code = ("import os, sys, numpy as np\n"
            "a = np.load(sys.argv[1], mmap_mode='r')\n"
            "f = open(sys.argv[1], 'rb'); fd = f.fileno()\n"
            "print(a.shape, float(a.sum()), os.fstat(fd).st_size)\n"
            "proc = os.open('/proc/self/fd', os.O_RDONLY)  # the kernel's name of the file\n"
            "print(os.readlink(str(fd), dir_fd=proc).startswith('/memfd'))\n")
    got = run(pack, at, sys.executable, "-c", code, at / "big/noise.npy").stdout.splitlines()
    want = plain(sys.executable, "-c", code, src / "big/noise.npy").splitlines()
    assert got[0] == want[0]
    # a file read whole at open (this one, 2.4 MB) hands the bytes its open read to the
    # library, in an in-memory copy sealed read-only, rather than have it read them again;
    # a large file's is a real descriptor on the shard (test_preload_fileno.py)
    assert got[1] == b"True"


def test_run_says_what_it_cannot_serve(packed: tuple[Path, Path], tmp_path: Path) -> None:
    src, pack = packed
    at = tmp_path / "data"
    at.mkdir()
    (at / "hidden.txt").write_bytes(b"on disk")
    proc = run(pack, at, "ls", "-1", at)
    assert proc.stdout.decode().splitlines() == sorted(os.listdir(src), key=lambda n: n.encode())
    assert f"{at} exists on disk: the staged view hides it" in proc.stderr.decode()
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return
    (tmp_path / "s.c").write_text("int main(void) { return 0; }\n")
    built = subprocess.run([cc, "-static", "-o", tmp_path / "static", tmp_path / "s.c"],
                           capture_output=True, check=False)
    if built.returncode != 0:  # no static libc here
        return
    proc = run(pack, at, tmp_path / "static")
    assert "is statically linked" in proc.stderr.decode()


@pytest.mark.skipif(shutil.which("strace") is None, reason="no strace (.ci/run installs it)")
def test_cold_files_with_a_tier_never_open_the_origin_shard_per_file(
        packed: tuple[Path, Path], tmp_path: Path) -> None:
    """With a tier, a file whose shard is not whole there is read through the helper (one
    download shared with the stream that places the shard): the library does not open the
    origin's shard for it (an open on the shared file system is a metadata operation per
    file); the helper's Store opens it once. The tier is too small for any piece, so the
    shard never becomes whole there while the files are read."""
    src, pack = packed
    at, tier = tmp_path / "data", tmp_path / "tier"
    with stagefs.open(pack) as fs:
        m = fs.manifest
        by_shard: dict[int, list[str]] = {}
        for p in sorted(src.rglob("*")):
            if p.is_file() and not p.is_symlink():
                rel = str(p.relative_to(src))
                e = fs.namespace.file_entry(rel)
                if int(m.stored[e]):
                    by_shard.setdefault(int(m.shard[e]), []).append(rel)
        shard, rels = max(by_shard.items(), key=lambda kv: len(kv[1]))
        name = m.shards[shard].name
    assert len(rels) >= 5
    log = tmp_path / "opens.log"
    got = run(pack, at, "strace", "-f", "-qq", "-e", "trace=openat,open", "-o", log, "cat",
              *(at / r for r in rels), tiers=[Path(f"{tier}:4096")])
    assert got.stdout == b"".join((src / r).read_bytes() for r in rels)
    opens = [line for line in log.read_text().splitlines() if str(pack / name) in line]
    assert not opens, opens  # cat's process never opened the origin's shard


def test_the_program_has_no_child_it_did_not_start(packed: tuple[Path, Path],
                                                   tmp_path: Path) -> None:
    """The helper is not a child of the program `stagefs run` becomes: a program that
    waits for all its children (strace -f, a process supervisor) would wait for the helper
    while the helper waits for it to end."""
    _, pack = packed
    code = ("import os\n"
            "try:\n    os.waitpid(-1, 0)\nexcept ChildProcessError:\n    print('none')\n")
    got = run(pack, tmp_path / "data", sys.executable, "-c", code, tiers=[tmp_path / "tier"])
    assert got.stdout == b"none\n"


def test_a_run_killed_with_its_helper_leaves_no_run_directory(packed: tuple[Path, Path],
                                                              tmp_path: Path) -> None:
    """A run killed with SIGKILL together with its helper (the OOM killer, a control group's
    kill) cannot remove its run directory (the helper's socket, the sidecar): the next
    `stagefs run` of the user removes it. Each such run left one in /dev/shm for good."""
    from stagefs.posix.preload import SIDECAR, _run_base

    _, pack = packed
    at = tmp_path / "killed-run-data"  # named in the sidecar: finds this run's directory
    argv = [sys.executable, "-m", "stagefs.cli", "run", "--dataset", str(pack), "--at", str(at)]
    proc = subprocess.Popen([*argv, "--", "sh", "-c", "echo started; exec sleep 60"],
                            env=_env(), start_new_session=True, stdout=subprocess.PIPE)
    mine = []
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"started\n"  # the helper listens, its sidecar written
        for d in Path(_run_base()).glob("stagefs-run-*"):
            with contextlib.suppress(OSError):
                if os.fsencode(at) + b"\0" in (d / SIDECAR).read_bytes():
                    mine.append(d)
    finally:
        ends = []  # the session's processes (the program, the helper), to wait for their end
        for p in Path("/proc").iterdir():
            with contextlib.suppress(OSError, ValueError):
                if os.getsid(int(p.name)) == proc.pid:
                    ends.append(os.pidfd_open(int(p.name)))
        os.killpg(proc.pid, signal.SIGKILL)  # the program and its helper, at once
        proc.wait()
        for fd in ends:
            select.select([fd], [], [], 60)
            os.close(fd)
        if proc.stdout is not None:
            proc.stdout.close()
    assert len(mine) == 1 and mine[0].is_dir(), mine
    mine[0].joinpath(SIDECAR).stat()  # still there: nobody removed it
    run(pack, at, "true")
    assert not mine[0].exists()
