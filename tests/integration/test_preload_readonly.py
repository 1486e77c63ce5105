"""Every descriptor `stagefs run` hands a program for a staged file is a read-only one, as
open(O_RDONLY) of a real file gives: a tier's copy, the origin's shard, or the helper's
in-memory copy (a file not whole in the tier yet, a compressed file). Writes through it
fail with EBADF, a shared writable mapping with EACCES, F_GETFL says O_RDONLY, and no
opener ever sees other bytes; dup, fork and read-only mappings work as before."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_preload import _env, plain, run

import stagefs
from conftest import random_bytes, text_bytes
from stagefs._native import preload_library
from tiers_helpers import compile_c

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(preload_library() is None,
                       reason="the preload library is not built (no C compiler at install)"),
]

FILES = {"small.bin": random_bytes(70_000, 21),  # no pieces: a small file whole
         "big/large.bin": random_bytes(5 * 2**20 + 777, 22),  # five pieces and a short one
         "notes.txt": text_bytes(200_000, 23)}  # stored compressed: always the helper's copy

# probe FILE...: for each file, a line that must read as for the plain file (the access
# mode, what a write, a pwrite and a shared writable mapping give, FNV hashes of the bytes
# read, mapped read-only, read through a dup, in a forked child, and by a new open after
# the writes), then a line saying whether the descriptor is an in-memory copy and, if so,
# what a write through a reopen of it for writing gives (its bytes are sealed)
PROBE = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
static unsigned char buf[8 << 20];
static unsigned long long fnv(const unsigned char *p, size_t n) {
    uint64_t h = 14695981039346656037ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ULL;
    return (unsigned long long)h;
}
static const char *said(long rc) { return rc >= 0 ? "done" : strerror(errno); }
static unsigned long long whole(int fd) {
    size_t n = 0;
    ssize_t got;
    while ((got = pread(fd, buf + n, sizeof buf - n, (off_t)n)) > 0) n += (size_t)got;
    return fnv(buf, n);
}
int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        int fd = open(argv[i], O_RDONLY);
        struct stat st;
        if (fd < 0 || fstat(fd, &st) != 0) { perror(argv[i]); return 2; }
        int acc = fcntl(fd, F_GETFL) & O_ACCMODE;
        const char *pw = said(pwrite(fd, "WRITTEN!", 8, 0));
        const char *wr = said(write(fd, "WRITTEN!", 8));
        void *mw = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        const char *mws = mw == MAP_FAILED ? strerror(errno) : "done";
        unsigned long long rd = whole(fd);
        unsigned char *m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
        unsigned long long mr = m == MAP_FAILED ? 0 : fnv(m, (size_t)st.st_size);
        int d = dup(fd);
        unsigned long long dp = whole(d);
        int pipefd[2];
        if (pipe(pipefd) != 0) return 3;
        pid_t pid = fork();
        if (pid == 0) { unsigned long long h = whole(fd); (void)!write(pipefd[1], &h, sizeof h); _exit(0); }
        unsigned long long fk = 0;
        (void)!read(pipefd[0], &fk, sizeof fk);
        waitpid(pid, NULL, 0);
        /* the kernel's name of the file behind fd: relative to /proc/self/fd (the path
         * /proc/self/fd/N names the staged file itself, as on the plain tree) */
        char link[64], target[256] = "";
        int procfd = open("/proc/self/fd", O_RDONLY | O_DIRECTORY);
        snprintf(link, sizeof link, "%d", fd);
        ssize_t tl = readlinkat(procfd, link, target, sizeof target - 1);
        int memfd = tl > 0 && strncmp(target, "/memfd:", 7) == 0;
        const char *rw = "-";
        if (memfd) {  /* the in-memory copy reopened for writing: sealed */
            int w = openat(procfd, link, O_RDWR);
            rw = w < 0 ? strerror(errno) : said(pwrite(w, "WRITTEN!", 8, 0));
        }
        close(procfd);
        int again = open(argv[i], O_RDONLY);
        unsigned long long ag = whole(again);
        printf("%s: mode %d, pwrite %s, write %s, shared writable mmap %s, read %llx mmap %llx "
               "dup %llx fork %llx again %llx, after %llx\n", strrchr(argv[i], '/') + 1, acc,
               pw, wr, mws, rd, mr, dp, fk, ag, whole(fd));
        printf("memfd %d reopened %s\n", memfd, rw);
        close(again); close(d); close(fd);
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_c(tmp_path_factory, "roprobe", PROBE)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    src = tmp_path_factory.mktemp("readonly") / "src"
    for rel, data in FILES.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    pack = src.parent / "pack"
    stagefs.pack(str(src), str(pack), progress=False)
    with stagefs.open(pack) as fs:
        m = fs.manifest
        codec = {rel: int(m.codec[fs.namespace.file_entry(rel)]) for rel in FILES}
    assert codec["notes.txt"] and not codec["small.bin"] and not codec["big/large.bin"]
    return src, pack


def _split(out: bytes) -> tuple[list[str], list[str]]:
    lines = out.decode().splitlines()
    return lines[0::2], lines[1::2]


@pytest.mark.parametrize("holder", ["cold tier", "warm tier", "no tier"])
def test_a_staged_file_s_descriptor_is_read_only(tree: tuple[Path, Path], tmp_path: Path,
                                                 probe: Path, holder: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """cold: the tier can hold no shard, every file is the helper's copy; warm: the shards
    are staged, the raw files are the tier's copies; no tier: the origin's shards."""
    src, pack = tree
    at, tier = tmp_path / "data", tmp_path / "tier"
    tiers = {"cold tier": [Path(f"{tier}:4096")], "warm tier": [tier], "no tier": []}[holder]
    if holder == "warm tier":
        rt = tmp_path / "rt"
        subprocess.run([sys.executable, "-m", "stagefs.cli", "stage", str(pack), "--tier",
                        str(tier), "--runtime", str(rt), "--no-progress"], check=True,
                       env=_env(), capture_output=True, timeout=120)
        monkeypatch.setenv("STAGEFS_RUNTIME", str(rt))
    want, _ = _split(plain(probe, *(src / rel for rel in FILES)))
    assert all("mode 0, pwrite Bad file descriptor, write Bad file descriptor, shared "
               "writable mmap Permission denied" in line for line in want)  # as it says
    got = run(pack, at, probe, *(at / rel for rel in FILES), tiers=tiers)
    lines, copies = _split(got.stdout)
    assert lines == want, got.stderr.decode()
    # the helper's copies are the ones this is about: the probe saw them where expected
    memfd = [line.startswith("memfd 1") for line in copies]
    assert memfd == {"cold tier": [True, True, True], "warm tier": [False, False, True],
                     "no tier": [False, False, True]}[holder], copies
    for line in copies:
        assert line in ("memfd 0 reopened -", "memfd 1 reopened Operation not permitted"), line
