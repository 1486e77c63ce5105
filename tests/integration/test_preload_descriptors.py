"""What a program does with a staged descriptor beyond reading it, under `stagefs run`, as on
the plain tree: reopen it by a path that names it (/dev/stdin, /dev/fd/N, /proc/self/fd/N),
rewind a directory's listing with lseek, open a file O_PATH, run a subprocess (vfork) while
it holds staged descriptors; and a call that would change the file behind one (fchmod,
fchown, futimens, fsetxattr) fails with EROFS and changes nothing in the pack."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from test_preload import plain, run

from conftest import pack_files, random_bytes
from stagefs._native import preload_library
from tiers_helpers import compile_c

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(preload_library() is None,
                       reason="the preload library is not built (no C compiler at install)"),
]

FILES = {"d/a.bin": random_bytes(5000, 31), "d/b.bin": random_bytes(70_000, 32),
         "d/sub/c.bin": random_bytes(3000, 33), "e.bin": random_bytes(2 * 2**20 + 5, 34)}

# probe ROOT: one line per check, the root cut from the paths it prints
PROBE = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
static unsigned char buf[4 << 20];
static const char *root;
static unsigned long long fnv(const unsigned char *p, long n) {
    uint64_t h = 14695981039346656037ULL;
    for (long i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ULL;
    return (unsigned long long)h;
}
static const char *rel(const char *p) {
    size_t n = strlen(root);
    return strncmp(p, root, n) == 0 ? p + n : p;
}
static void reopen(const char *what, const char *path) {
    int fd = open(path, O_RDONLY);
    long n = 0, got;
    while (fd >= 0 && (got = read(fd, buf + n, sizeof buf - (size_t)n)) > 0) n += got;
    struct stat st;
    int rc = stat(path, &st);
    printf("%s: open %s, %ld bytes %llx, stat %lld\n", what, fd < 0 ? strerror(errno) : "ok", n,
           fnv(buf, n), rc == 0 ? (long long)st.st_size : -1LL);
    if (fd >= 0) close(fd);
}
int main(int argc, char **argv) {
    root = argv[1];
    char p[4096], link[64], target[4096];
    snprintf(p, sizeof p, "%s/d/a.bin", root);
    int fd = open(p, O_RDONLY);
    if (fd < 0) { perror(p); return 2; }
    (void)!read(fd, buf, 100);  /* a reopen starts at 0, not here */
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    reopen("proc", link);
    snprintf(link, sizeof link, "/proc/%d/fd/%d", (int)getpid(), fd);
    reopen("pid", link);
    snprintf(link, sizeof link, "/dev/fd/%d", fd);
    reopen("devfd", link);
    dup2(fd, 0);
    reopen("stdin", "/dev/stdin");
    ssize_t tl = readlink(link, target, sizeof target - 1);
    target[tl < 0 ? 0 : tl] = 0;
    printf("readlink %s\n", tl < 0 ? strerror(errno) : rel(target));
    char *rp = realpath(link, NULL);
    printf("realpath %s\n", rp ? rel(rp) : strerror(errno));
    /* a directory's descriptor: a path on through it */
    snprintf(p, sizeof p, "%s/d", root);
    int dfd = open(p, O_RDONLY | O_DIRECTORY);
    snprintf(p, sizeof p, "/proc/self/fd/%d/sub/c.bin", dfd);
    reopen("through dir", p);
    snprintf(p, sizeof p, "/dev/fd/%d/nothing", dfd);
    reopen("missing", p);
    snprintf(p, sizeof p, "/dev/fd/%d/x", fd);
    reopen("through file", p);
    /* getdents64 listed to its end, lseek back to the start, listed again */
    char db[65536];
    long first = getdents64(dfd, db, sizeof db), end = getdents64(dfd, db, sizeof db);
    off_t at = lseek(dfd, 0, SEEK_SET);
    long again = getdents64(dfd, db, sizeof db);
    printf("getdents %d %ld lseek %lld again %d\n", first > 0, end, (long long)at, again == first);
    /* O_PATH: a name, no bytes; a reopen through /proc gives them */
    snprintf(p, sizeof p, "%s/d/b.bin", root);
    int op = open(p, O_PATH);
    struct stat st;
    fstat(op, &st);
    ssize_t r = read(op, buf, 10);
    printf("O_PATH fstat %lld read %s\n", (long long)st.st_size, r < 0 ? strerror(errno) : "bytes");
    snprintf(link, sizeof link, "/proc/self/fd/%d", op);
    reopen("O_PATH reopen", link);
    return 0;
}
"""

# fdwrite ROOT: what each call that changes the file behind a descriptor gives
FDWRITE = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/xattr.h>
#include <unistd.h>
static void said(const char *what, int rc) { printf("%s %s\n", what, rc == 0 ? "done" : strerror(errno)); }
int main(int argc, char **argv) {
    char p[4096];
    snprintf(p, sizeof p, "%s/d/a.bin", argv[1]);
    int fd = open(p, O_RDONLY);
    snprintf(p, sizeof p, "%s/d", argv[1]);
    int dfd = open(p, O_RDONLY | O_DIRECTORY);
    struct timespec ts[2] = {{1, 0}, {1, 0}};
    struct timeval tv[2] = {{1, 0}, {1, 0}};
    said("fchmod", fchmod(fd, 0600));
    said("fchown", fchown(fd, 1, 1));
    said("futimens", futimens(fd, ts));
    said("futimes", futimes(fd, tv));
    said("fsetxattr", fsetxattr(fd, "user.stagefs", "1", 1, 0));
    said("fremovexattr", fremovexattr(fd, "user.stagefs"));
    said("fchmod dir", fchmod(dfd, 0700));
    return 0;
}
"""


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("descriptors")
    pack = pack_files(base, "src", FILES)
    return base / "src", pack


@pytest.mark.parametrize("tiered", [False, True])
def test_a_path_naming_a_staged_descriptor_is_the_file(tree: tuple[Path, Path],
                                                       tmp_path: Path, tiered: bool,
                                                       tmp_path_factory: pytest.TempPathFactory
                                                       ) -> None:
    """/proc/self/fd/N of a staged file is the file (the kernel would reopen the whole
    shard it lies in), a directory's is the directory, and lseek rewinds a listing."""
    src, pack = tree
    probe = compile_c(tmp_path_factory, "fdpaths", PROBE)
    at = tmp_path / "data"
    got = run(pack, at, probe, at, tiers=[tmp_path / "tier"] if tiered else [])
    want = plain(probe, src)
    assert got.stdout.decode() == want.decode()
    assert f"{len(FILES['d/a.bin'])} bytes" in want.decode()


def test_a_change_through_a_staged_descriptor_is_refused(
        tree: tuple[Path, Path], tmp_path: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """fchmod and the like succeed on a read-only descriptor: on a staged one they would
    change the pack's shard (or a tier's copy). Each fails with EROFS, and the shards keep
    their mode, owner, times and attributes."""
    _, pack = tree
    probe = compile_c(tmp_path_factory, "fdwrite", FDWRITE)
    at = tmp_path / "data"

    def shards() -> list[tuple[int, int, int, int, list[str]]]:
        out = []
        for p in sorted(pack.iterdir()):
            st = p.stat()
            out.append((st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, os.listxattr(p)))
        return out

    before = shards()
    got = run(pack, at, probe, at).stdout.decode().splitlines()
    assert got == [f"{c} Read-only file system" for c in (
        "fchmod", "fchown", "futimens", "futimes", "fsetxattr", "fremovexattr", "fchmod dir")]
    assert shards() == before


SUBPROCESS = r"""
import hashlib, os, subprocess, sys
at = sys.argv[1]
os.chdir(os.path.join(at, "d"))
fd = os.open("b.bin", os.O_RDONLY)
print("stdin", hashlib.md5(subprocess.run(["cat"], stdin=os.open("a.bin", os.O_RDONLY),
                                          capture_output=True).stdout).hexdigest())
print("child", subprocess.run(["sh", "-c", "pwd; md5sum c.bin"], cwd="sub",
                              capture_output=True).stdout.decode().replace(at, "AT"))
print("cwd", os.getcwd().replace(at, "AT"), len(open("a.bin", "rb").read()))
data = os.read(fd, 1 << 24)
print("fd", len(data), hashlib.md5(data).hexdigest(), os.fstat(fd).st_size)
"""


def test_a_subprocess_leaves_the_parent_s_descriptors_and_directory(
        tree: tuple[Path, Path], tmp_path: Path) -> None:
    """subprocess starts its child with vfork: the child's close_fds, dup2 and chdir run in
    the parent's memory. The parent's staged descriptor still reads its file (not the raw
    shard behind it) and its directory is still its own; the child gets what it was given."""
    src, pack = tree
    at = tmp_path / "data"
    script = tmp_path / "sub.py"
    script.write_text(SUBPROCESS)
    got = run(pack, at, sys.executable, script, at).stdout.decode()
    want = plain(sys.executable, script, src).decode().replace(str(src), "AT")
    assert got == want
    assert f"fd {len(FILES['d/b.bin'])} " in want
