/* stagefs preload library: any dynamically linked program reads a staged dataset.
 *
 * `stagefs run --at DIR` loads this library with LD_PRELOAD. Every libc call that takes a
 * path or a descriptor is wrapped: a path under DIR (the "root") is served from the pack's
 * manifest, every other path and descriptor goes to the real call untouched
 * (dlsym(RTLD_NEXT)). docs/decisions/0014-preload.md says why, and what it does not cover.
 *
 * Where things come from:
 * - The namespace is the pack's manifest, mapped read-only. `stagefs run` writes a small
 *   "sidecar" (posix/preload.py) naming the manifest, where each of its arrays lies (the
 *   Python reader has validated them), the node's tier directories, the origin, and the
 *   helper's socket. The manifest's header (length, body checksum) must match the sidecar,
 *   so the arrays used are the ones Python checked.
 * - A staged regular file is a real descriptor on the file that holds its bytes: the tier's
 *   copy of its shard (else the origin's shard), positioned at the file's offset. Its file
 *   position lives in the kernel (kernel offset = base + position), so dup'd descriptors and
 *   forked children share it as they would a real file's. Reads are preads of that file,
 *   each piece (or a small file whole) verified against its xxh3 checksum before bytes are
 *   returned, in the caller's buffer when the read wants it whole, else in a buffer of the
 *   thread that serves the rest of it (vread); a process remembers which pieces it
 *   verified on which source.
 * - Compressed files, datasets without direct shards (in place, a cluster), and any copy
 *   that fails its checksum go to the helper (a Python process that `stagefs run` starts):
 *   it reads the file through the Store (the one verified read path: every holder in turn)
 *   and passes back a memfd holding the file (SCM_RIGHTS), sealed and reopened read-only
 *   here (a write through it fails as through any read-only descriptor). For a copy that
 *   failed, that memfd then replaces the descriptor (dup3), keeping its number. A Python
 *   program's file object that holds a small file's bytes already (the Python-level
 *   interception read them through its Store) hands them over the same way, in a memfd it
 *   made, when the program asks for its descriptor (stagefs_preload_adopt).
 * - A staged directory is a real descriptor on an empty directory of the run (so a call
 *   that escapes the wrappers sees nothing, never other bytes); its listing comes from the
 *   manifest.
 * - A table indexed by descriptor number says which descriptors are staged. Each use
 *   checks the descriptor still refers to the file recorded (device and inode), and every
 *   real call that returns a descriptor clears its row: a number reused after a close the
 *   wrappers did not see is never taken for a staged one.
 * - exec: the staged descriptors a child inherits and the current directory (when it is in
 *   the staged tree) travel in environment variables that the exec wrappers set; LD_PRELOAD
 *   is put back if the new environment dropped it.
 */
#define _GNU_SOURCE
#define _DEFAULT_SOURCE
#pragma GCC diagnostic ignored "-Wnonnull-compare"
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include "../_xxh3.h"

#define API __attribute__((visibility("default")))
#define NONE 0xFFFFFFFFu

enum { K_FILE = 0, K_DIR = 1, K_LINK = 2 };
enum { A_PATH_OFF, A_HASH, A_PARENT, A_KIND, A_MODE, A_MTIME, A_SIZE, A_SHARD, A_OFFSET,
       A_STORED, A_CODEC, A_CHECKSUM, A_FIRST, A_COUNT, A_PIECE, A_SLOTS, A_STRINGS, A_PIECES,
       N_ARRAYS };
enum { SIDECAR_HEAD = 64 + N_ARRAYS * 16, MAX_SOURCES = 8, MAX_LINKS = 40 };

extern char **environ;

/* ---- the dataset ------------------------------------------------------------------------ */

static struct {
    int active;
    uint64_t n, piece_size, dev, nslots, npieces, nstrings;
    uint32_t nshards, ntiers, direct;
    const uint64_t *path_off, *hash, *size, *offset, *stored, *checksum, *pieces;
    const uint32_t *parent, *mode, *shard, *first, *count, *piece, *slots;
    const int64_t *mtime;
    const uint8_t *kind, *codec, *strings;
    char *root; size_t root_len;
    char *socket_path, *empty_dir, *origin_dir, *self_path, *sidecar_path;
    char *stats_dir;   /* where this process's read counters go ("": not counted) */
    char *tier_kinds;  /* per tier: 'm' memory, 'd' disk (the holder status names) */
    char **tier_dirs, **shard_names;
    uid_t uid; gid_t gid;
    long page;
} D;

/* ---- the real calls --------------------------------------------------------------------- */

#define REAL(ret, name, ...) static ret (*real_##name)(__VA_ARGS__)
REAL(int, open, const char *, int, ...);
REAL(int, openat, int, const char *, int, ...);
REAL(int, close, int);
REAL(ssize_t, read, int, void *, size_t);
REAL(ssize_t, pread, int, void *, size_t, off_t);
REAL(ssize_t, readv, int, const struct iovec *, int);
REAL(ssize_t, preadv, int, const struct iovec *, int, off_t);
REAL(ssize_t, preadv2, int, const struct iovec *, int, off_t, int);
REAL(off_t, lseek, int, off_t, int);
REAL(int, dup, int);
REAL(int, dup2, int, int);
REAL(int, dup3, int, int, int);
REAL(int, fcntl, int, int, ...);
REAL(int, fstatat, int, const char *, struct stat *, int);
REAL(int, fstat, int, struct stat *);
REAL(int, statx, int, const char *, int, unsigned, struct statx *);
REAL(int, faccessat, int, const char *, int, int);
REAL(DIR *, opendir, const char *);
REAL(DIR *, fdopendir, int);
REAL(struct dirent *, readdir, DIR *);
REAL(struct dirent64 *, readdir64, DIR *);
REAL(int, closedir, DIR *);
REAL(int, dirfd, DIR *);
REAL(void, rewinddir, DIR *);
REAL(long, telldir, DIR *);
REAL(void, seekdir, DIR *, long);
REAL(ssize_t, getdents64, int, void *, size_t);
REAL(void *, mmap, void *, size_t, int, int, int, off_t);
REAL(ssize_t, readlinkat, int, const char *, char *, size_t);
REAL(char *, realpath, const char *, char *);
REAL(char *, getcwd, char *, size_t);
REAL(int, chdir, const char *);
REAL(int, fchdir, int);
REAL(FILE *, fopen, const char *, const char *);
REAL(FILE *, freopen, const char *, const char *, FILE *);
REAL(FILE *, fdopen, int, const char *);
REAL(ssize_t, getxattr, const char *, const char *, void *, size_t);
REAL(ssize_t, lgetxattr, const char *, const char *, void *, size_t);
REAL(ssize_t, fgetxattr, int, const char *, void *, size_t);
REAL(ssize_t, listxattr, const char *, char *, size_t);
REAL(ssize_t, llistxattr, const char *, char *, size_t);
REAL(ssize_t, flistxattr, int, char *, size_t);
REAL(int, execve, const char *, char *const[], char *const[]);
REAL(int, execveat, int, const char *, char *const[], char *const[], int);
REAL(int, execvpe, const char *, char *const[], char *const[]);
REAL(int, posix_spawn, pid_t *, const char *, const posix_spawn_file_actions_t *,
     const posix_spawnattr_t *, char *const[], char *const[]);
REAL(int, posix_spawnp, pid_t *, const char *, const posix_spawn_file_actions_t *,
     const posix_spawnattr_t *, char *const[], char *const[]);
REAL(ssize_t, copy_file_range, int, off_t *, int, off_t *, size_t, unsigned);
REAL(ssize_t, sendfile, int, int, off_t *, size_t);
REAL(ssize_t, splice, int, off_t *, int, off_t *, size_t, unsigned);
REAL(int, close_range, unsigned, unsigned, int);
/* calls that change the file system: refused under the root, else passed on */
REAL(int, unlinkat, int, const char *, int);
REAL(int, renameat2, int, const char *, int, const char *, unsigned);
REAL(int, mkdirat, int, const char *, mode_t);
REAL(int, fchmodat, int, const char *, mode_t, int);
REAL(int, fchownat, int, const char *, uid_t, gid_t, int);
REAL(int, truncate, const char *, off_t);
REAL(int, linkat, int, const char *, int, const char *, int);
REAL(int, symlinkat, const char *, int, const char *);
REAL(int, utimensat, int, const char *, const struct timespec[2], int);
REAL(int, mknodat, int, const char *, mode_t, dev_t);
REAL(int, setxattr, const char *, const char *, const void *, size_t, int);
REAL(int, lsetxattr, const char *, const char *, const void *, size_t, int);
REAL(int, removexattr, const char *, const char *);
REAL(int, lremovexattr, const char *, const char *);
REAL(int, fchmod, int, mode_t);
REAL(int, fchown, int, uid_t, gid_t);
REAL(int, futimens, int, const struct timespec[2]);
REAL(int, futimes, int, const struct timeval[2]);
REAL(int, fsetxattr, int, const char *, const void *, size_t, int);
REAL(int, fremovexattr, int, const char *);

static void *next_sym(const char *name) {
    void *p = dlsym(RTLD_NEXT, name);
    return p;
}

static void resolve_real(void) {
#define R(name) real_##name = next_sym(#name)
    R(open); R(openat); R(close); R(read); R(pread); R(readv); R(preadv); R(preadv2);
    R(lseek); R(dup); R(dup2); R(dup3); R(fcntl); R(fstatat); R(fstat); R(statx);
    R(faccessat); R(opendir); R(fdopendir); R(readdir); R(readdir64); R(closedir); R(dirfd);
    R(rewinddir); R(telldir); R(seekdir); R(getdents64); R(mmap); R(readlinkat); R(realpath);
    R(getcwd); R(chdir); R(fchdir); R(fopen); R(freopen); R(fdopen); R(getxattr);
    R(lgetxattr); R(fgetxattr); R(listxattr); R(llistxattr); R(flistxattr); R(execve);
    R(execveat); R(execvpe); R(posix_spawn); R(posix_spawnp); R(copy_file_range); R(sendfile);
    R(splice); R(close_range); R(unlinkat); R(renameat2); R(mkdirat); R(fchmodat);
    R(fchownat); R(truncate); R(linkat); R(symlinkat); R(utimensat); R(mknodat); R(setxattr);
    R(lsetxattr); R(removexattr); R(lremovexattr); R(fchmod); R(fchown); R(futimens); R(futimes);
    R(fsetxattr); R(fremovexattr);
#undef R
}

/* ---- descriptors ------------------------------------------------------------------------ */

enum { F_NONE = 0, F_SHARD = 1, F_MEM = 2, F_DIRFD = 3 };

typedef struct {
    uint32_t seq;    /* even: stable; odd: being written (a sequence lock, one per row) */
    uint8_t kind;    /* F_*: 0 = not staged */
    uint8_t src;     /* F_SHARD: which source (tier index, ntiers for the origin, ntiers + 1
                      * for the origin's descriptor of a large file read through the helper) */
    uint32_t e;      /* the entry */
    uint64_t base;   /* F_SHARD: the file's offset in its shard */
    uint64_t dev, ino; /* the file the descriptor refers to when it was made */
    uint64_t dpos;   /* F_DIRFD: getdents64's position */
} Row;

static Row *rows;
static int max_fd;
static int top_fd = -1;  /* the highest descriptor ever given a row */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;  /* the list of staged DIR streams */
static uint8_t *vfile[MAX_SOURCES], *vpiece[MAX_SOURCES];  /* verified marks per source */
static uint8_t *touched;  /* shards this process asked the helper to place */

static int sys_fstat(int fd, struct stat *st) { return (int)syscall(SYS_fstat, fd, st); }

/* A vfork child (subprocess's, between vfork and exec) runs in its parent's memory: a
 * close, dup2 or chdir it makes must not change the parent's table (the parent's staged
 * descriptors would then be read as raw shard bytes), yet the program it execs must
 * inherit what it set up (stdin dup2'd from a staged file). So a process that is not the
 * table's owner writes to a few rows of its own (kid), read before the table, and leaves
 * the table's rows alone: closed in the child, they fail its fstat check. */
enum { KID_ROWS = 16 };
static pid_t owner;  /* the process whose memory this is */
static struct {
    pid_t pid;       /* the child the rows below are of */
    int n, fd[KID_ROWS];
    Row r[KID_ROWS];
    int cwd_set;     /* it changed directory: its current directory, for its exec */
    char vcwd[PATH_MAX];
} kid;

/* Does this process run in another's memory (a vfork child)? Its kid rows, made current. */
static int borrowed(void) {
    pid_t me = getpid();
    if (me == owner) return 0;
    if (kid.pid != me) { kid.pid = me; kid.n = 0; kid.cwd_set = 0; }
    return 1;
}

static int kid_find(int fd) {
    for (int i = 0; i < kid.n; i++) if (kid.fd[i] == fd) return i;
    return -1;
}

/* The child's row for fd (kind 0: cleared); dropped if there is no room (the program it
 * execs then reads that descriptor as it is). */
static void kid_set(int fd, const Row *r) {
    int i = kid_find(fd);
    if (i < 0 && kid.n < KID_ROWS) { i = kid.n++; kid.fd[i] = fd; }
    if (i >= 0) { kid.r[i] = *r; kid.r[i].seq = 0; }
}

/* The descriptor table takes no lock: a signal handler that reads a staged descriptor while
 * the thread it interrupted is inside a read, an open or a close must not wait for that
 * thread (it would wait forever). Each row has a sequence lock: a reader copies the row and
 * tries again if a writer was in it meanwhile (it never waits on a writer that cannot run);
 * writers of one row (only the opener, closer or reader of that one descriptor) take it
 * with a compare-and-swap. */
#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

static void row_copy(int fd, Row *out) {
    Row *r = &rows[fd];
    for (;;) {
        uint32_t s1 = __atomic_load_n(&r->seq, __ATOMIC_ACQUIRE);
        if (s1 & 1) { cpu_relax(); continue; }
        out->kind = __atomic_load_n(&r->kind, __ATOMIC_RELAXED);
        out->src = __atomic_load_n(&r->src, __ATOMIC_RELAXED);
        out->e = __atomic_load_n(&r->e, __ATOMIC_RELAXED);
        out->base = __atomic_load_n(&r->base, __ATOMIC_RELAXED);
        out->dev = __atomic_load_n(&r->dev, __ATOMIC_RELAXED);
        out->ino = __atomic_load_n(&r->ino, __ATOMIC_RELAXED);
        out->dpos = __atomic_load_n(&r->dpos, __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&r->seq, __ATOMIC_RELAXED) == s1) { out->seq = s1; return; }
    }
}

static void row_begin(int fd) {
    uint32_t *seq = &rows[fd].seq;
    for (;;) {
        uint32_t s = __atomic_load_n(seq, __ATOMIC_RELAXED);
        if (!(s & 1) && __atomic_compare_exchange_n(seq, &s, s + 1, 0, __ATOMIC_ACQUIRE,
                                                    __ATOMIC_RELAXED))
            break;
        cpu_relax();
    }
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

static void row_end(int fd) { __atomic_add_fetch(&rows[fd].seq, 1, __ATOMIC_RELEASE); }

/* The row of fd, if fd is staged and still refers to the file recorded; else 0. */
static int get_row(int fd, Row *out) {
    if (!D.active || fd < 0 || fd >= max_fd) return 0;
    int i = -1;  /* >= 0: a vfork child's own row (looked for only where one may be) */
    if (kid.n && kid_find(fd) >= 0 && borrowed() && (i = kid_find(fd)) >= 0) {
        *out = kid.r[i];
        if (!out->kind) return 0;
    } else {
        if (!__atomic_load_n(&rows[fd].kind, __ATOMIC_ACQUIRE)) return 0;
        row_copy(fd, out);
        if (!out->kind) return 0;
    }
    struct stat st;
    if (sys_fstat(fd, &st) != 0 || (uint64_t)st.st_dev != out->dev || (uint64_t)st.st_ino != out->ino) {
        if (i >= 0 || borrowed()) return 0;  /* the table is the parent's */
        row_begin(fd);  /* closed behind the wrappers' back, and maybe reused */
        if (rows[fd].dev == out->dev && rows[fd].ino == out->ino)
            __atomic_store_n(&rows[fd].kind, F_NONE, __ATOMIC_RELAXED);
        row_end(fd);
        return 0;
    }
    return 1;
}

static void set_row(int fd, const Row *r) {
    if (fd < 0 || fd >= max_fd) return;
    if (borrowed()) { kid_set(fd, r); return; }
    for (int top = __atomic_load_n(&top_fd, __ATOMIC_RELAXED); fd > top;)
        if (__atomic_compare_exchange_n(&top_fd, &top, fd, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            break;
    row_begin(fd);
    Row *w = &rows[fd];
    __atomic_store_n(&w->src, r->src, __ATOMIC_RELAXED);
    __atomic_store_n(&w->e, r->e, __ATOMIC_RELAXED);
    __atomic_store_n(&w->base, r->base, __ATOMIC_RELAXED);
    __atomic_store_n(&w->dev, r->dev, __ATOMIC_RELAXED);
    __atomic_store_n(&w->ino, r->ino, __ATOMIC_RELAXED);
    __atomic_store_n(&w->dpos, r->dpos, __ATOMIC_RELAXED);
    __atomic_store_n(&w->kind, r->kind, __ATOMIC_RELEASE);
    row_end(fd);
}

static void clear_row(int fd) {
    if (!D.active || fd < 0 || fd >= max_fd) return;
    if (kid.n && kid_find(fd) >= 0 && borrowed()) {
        if (kid_find(fd) >= 0) kid_set(fd, &(Row){.kind = F_NONE});
        return;
    }
    if (!__atomic_load_n(&rows[fd].kind, __ATOMIC_ACQUIRE)) return;
    if (borrowed()) return;  /* a vfork child: the parent's row stays (its fstat check fails) */
    row_begin(fd);
    __atomic_store_n(&rows[fd].kind, F_NONE, __ATOMIC_RELAXED);
    row_end(fd);
}

/* A row for fd with kind and entry, its file identified by fstat. */
static int make_row(int fd, int kind, uint32_t e, uint64_t base, int src) {
    struct stat st;
    if (fd >= max_fd) { real_close(fd); errno = EMFILE; return -1; }
    if (sys_fstat(fd, &st) != 0) { int err = errno; real_close(fd); errno = err; return -1; }
    Row r = {.kind = (uint8_t)kind, .src = (uint8_t)src, .e = e, .base = base,
             .dev = (uint64_t)st.st_dev, .ino = (uint64_t)st.st_ino};
    set_row(fd, &r);
    return fd;
}

/* ---- the manifest ----------------------------------------------------------------------- */

static const char *path_of(uint32_t e, size_t *len) {
    *len = D.path_off[e + 1] - D.path_off[e];
    return (const char *)D.strings + D.path_off[e];
}

static const char *name_of(uint32_t e, size_t *len) {
    size_t n;
    const char *p = path_of(e, &n);
    const char *slash = memrchr(p, '/', n);
    if (slash) { *len = n - (size_t)(slash + 1 - p); return slash + 1; }
    *len = n;
    return p;
}

/* The entry at the relative path key, or -1 (one pass over the table at most). */
static int64_t lookup(const char *key, size_t len) {
    uint64_t h = xxh3_64(key, len), mask = D.nslots - 1;
    for (uint64_t i = h & mask, probes = 0; probes < D.nslots; i = (i + 1) & mask, probes++) {
        uint32_t v = D.slots[i];
        if (v == 0 || v > D.n) return -1;
        uint32_t e = v - 1;
        if (D.hash[e] != h) continue;
        size_t n;
        const char *p = path_of(e, &n);
        if (n == len && memcmp(p, key, len) == 0) return e;
    }
    return -1;
}

static uint32_t dir_links(uint32_t e) {
    uint32_t n = 2;
    if (D.first[e] == NONE) return n;
    for (uint32_t c = D.first[e], k = 0; k < D.count[e] && c + k < D.n; k++)
        n += D.kind[c + k] == K_DIR;
    return n;
}

static void fill_stat(uint32_t e, struct stat *st) {
    memset(st, 0, sizeof *st);
    st->st_dev = D.dev;
    st->st_ino = e + 1;
    st->st_mode = D.mode[e];
    st->st_nlink = D.kind[e] == K_DIR ? dir_links(e) : 1;
    st->st_uid = D.uid;
    st->st_gid = D.gid;
    st->st_size = (off_t)D.size[e];
    /* the preferred I/O size: a file in pieces, one piece (cat and cp read that much at a
     * time, so each read is a whole piece, hashed in their buffer, with no copy of ours);
     * another file, 64 KiB (stdio and Python size their buffers by it) */
    st->st_blksize = D.size[e] > D.piece_size && D.piece_size ? (blksize_t)D.piece_size : 65536;
    st->st_blocks = (blkcnt_t)((D.size[e] + 511) >> 9);
    int64_t ns = D.mtime[e];
    int64_t s = ns >= 0 ? ns / 1000000000 : -((-ns + 999999999) / 1000000000);
    struct timespec t = {.tv_sec = s, .tv_nsec = ns - s * 1000000000};
    st->st_atim = st->st_mtim = st->st_ctim = t;
}

static void fill_statx(uint32_t e, struct statx *sx) {
    struct stat st;
    fill_stat(e, &st);
    memset(sx, 0, sizeof *sx);
    sx->stx_mask = STATX_BASIC_STATS;
    sx->stx_blksize = (uint32_t)st.st_blksize;
    sx->stx_nlink = (uint32_t)st.st_nlink;
    sx->stx_uid = st.st_uid;
    sx->stx_gid = st.st_gid;
    sx->stx_mode = (uint16_t)st.st_mode;
    sx->stx_ino = st.st_ino;
    sx->stx_size = (uint64_t)st.st_size;
    sx->stx_blocks = (uint64_t)st.st_blocks;
    struct statx_timestamp t = {.tv_sec = st.st_mtim.tv_sec, .tv_nsec = (uint32_t)st.st_mtim.tv_nsec};
    sx->stx_atime = sx->stx_ctime = sx->stx_mtime = t;
    sx->stx_dev_major = major(D.dev);
    sx->stx_dev_minor = minor(D.dev);
}

/* ---- paths ------------------------------------------------------------------------------ */

static char vcwd[PATH_MAX];  /* the current directory when it is in the staged tree, else "" */
/* the real current directory when the root lies below it (so that a relative path may enter
 * the tree: `cd /data; cat train/x` with --at /data/train), else "" */
static char rcwd[PATH_MAX];
static pthread_mutex_t cwd_lock = PTHREAD_MUTEX_INITIALIZER;

enum { R_REAL, R_STAGED, R_ERR };
typedef struct {
    int kind;
    int err;       /* R_ERR */
    uint32_t e;    /* R_STAGED */
    const char *path;  /* R_REAL: what to hand the real call (the caller's, or buf) */
    int entered;   /* the walk passed through the tree (so buf, not the caller's path) */
    char buf[PATH_MAX];
} Res;

static int starts_root(const char *p, size_t n) {
    return n >= D.root_len && memcmp(p, D.root, D.root_len) == 0 &&
           (n == D.root_len || p[D.root_len] == '/');
}

/* Append "/comp" to a real path being built lexically in out (len *n). */
static int push(char *out, size_t *n, const char *c, size_t cl) {
    if (*n + 1 + cl + 1 > PATH_MAX) return -1;
    out[(*n)++] = '/';
    memcpy(out + *n, c, cl);
    *n += cl;
    out[*n] = 0;
    return 0;
}

static void pop(char *out, size_t *n) {
    while (*n > 0 && out[*n - 1] != '/') (*n)--;
    if (*n > 0) (*n)--;
    out[*n] = 0;
}

/* Walk components of p (absolute, or relative to entry start) as the kernel would, staged
 * inside the root and lexically outside it. follow: follow a symlink in the last place. */
static void walk(Res *r, const char *p, int64_t start, int follow) {
    char real[PATH_MAX];
    size_t rn = 0;
    r->entered = start >= 0;
    int64_t cur = start;  /* >= 0: inside the tree at this entry; -1: outside, at real */
    int links = 0;
    real[0] = 0;
    char key[PATH_MAX];
    const char *s = p;
    while (*s) {
        while (*s == '/') s++;
        if (!*s) break;
        const char *c = s;
        while (*s && *s != '/') s++;
        size_t cl = (size_t)(s - c);
        int last = 1;
        for (const char *t = s; *t; t++) if (*t != '/') { last = 0; break; }
        if (cur < 0) {
            if (cl == 1 && c[0] == '.') continue;
            if (cl == 2 && c[0] == '.' && c[1] == '.') { pop(real, &rn); continue; }
            if (push(real, &rn, c, cl) < 0) { r->kind = R_ERR; r->err = ENAMETOOLONG; return; }
            if (rn == D.root_len && memcmp(real, D.root, rn) == 0) { cur = 0; r->entered = 1; }
            continue;
        }
        if (D.kind[cur] != K_DIR) { r->kind = R_ERR; r->err = ENOTDIR; return; }
        if (cl == 1 && c[0] == '.') continue;
        if (cl == 2 && c[0] == '.' && c[1] == '.') {
            if (cur == 0) {  /* out of the tree, to the root's parent */
                memcpy(real, D.root, D.root_len + 1);
                rn = D.root_len;
                pop(real, &rn);
                cur = -1;
            } else {
                cur = D.parent[cur];
            }
            continue;
        }
        size_t pl;
        const char *pp = path_of((uint32_t)cur, &pl);
        size_t kl = pl ? pl + 1 + cl : cl;
        if (kl >= sizeof key) { r->kind = R_ERR; r->err = ENAMETOOLONG; return; }
        if (pl) { memcpy(key, pp, pl); key[pl] = '/'; memcpy(key + pl + 1, c, cl); }
        else memcpy(key, c, cl);
        int64_t e = lookup(key, kl);
        if (e < 0) { r->kind = R_ERR; r->err = ENOENT; return; }
        if (D.kind[e] == K_LINK && (!last || follow || *s == '/')) {
            if (++links > MAX_LINKS) { r->kind = R_ERR; r->err = ELOOP; return; }
            if (D.first[e] == NONE || D.first[e] >= D.n) { r->kind = R_ERR; r->err = ENOENT; return; }
            e = D.first[e];
        }
        cur = e;
    }
    if (cur >= 0) {
        /* a trailing slash asks for a directory */
        size_t n = strlen(p);
        if (n && p[n - 1] == '/' && D.kind[cur] != K_DIR) { r->kind = R_ERR; r->err = ENOTDIR; return; }
        r->kind = R_STAGED;
        r->e = (uint32_t)cur;
        return;
    }
    if (rn == 0) { real[0] = '/'; real[1] = 0; }
    memcpy(r->buf, real, strlen(real) + 1);
    r->kind = R_REAL;
    r->path = r->buf;
}

static int needs_walk(const char *p) {
    return strstr(p, "/.") || strstr(p, "//") || (p[0] == '.' && (p[1] == 0 || p[1] == '/' || p[1] == '.'));
}

/* May a relative path taken from a real directory enter the tree? Only through "..", or
 * through a name of the root's own path (its first component, after any "./", is one of
 * the root's: `tar -C /data imagenet` with --at /data/imagenet asks fstatat(fd of /data,
 * "imagenet")). No system call: most *at calls with a real directory pass straight on. */
static int may_enter(const char *p) {
    while (p[0] == '.' && (p[1] == '/' || p[1] == 0)) { p++; while (*p == '/') p++; }
    size_t cl = strcspn(p, "/");
    if (cl == 0) return 0;
    if (cl == 2 && p[0] == '.' && p[1] == '.') return 1;
    for (const char *s = D.root; (s = strchr(s, '/')) != NULL;) {
        s++;
        if (strncmp(s, p, cl) == 0 && (s[cl] == '/' || s[cl] == 0)) return 1;
    }
    return 0;
}

/* (dirfd, path) with dirfd a real directory (no row): in the tree if the directory's path
 * and path lead into it (a directory above the root, as tar -C, find and fts open them),
 * else the real call's own. The directory's path is the kernel's (/proc/self/fd). */
static void resolve_below_real(Res *r, int dirfd, const char *path, size_t n, int follow) {
    if (!may_enter(path)) return;
    char link[32], abs[PATH_MAX];
    snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd);
    ssize_t dl = real_readlinkat(AT_FDCWD, link, abs, sizeof abs);
    if (dl <= 0 || dl >= (ssize_t)sizeof abs || abs[0] != '/') return;  /* no path: a socket, gone */
    size_t al = (size_t)dl;
    if (al == 1) al = 0;  /* "/" */
    if (al + 1 + n + 1 > PATH_MAX) return;
    abs[al] = '/';
    memcpy(abs + al + 1, path, n + 1);
    if (!starts_root(abs, al + 1 + n) && !needs_walk(abs)) return;
    walk(r, abs, -1, follow);
    if (r->kind == R_REAL && !r->entered) r->path = path;  /* never in the tree: as given */
}

/* The descriptor of this process an absolute path names (/proc/self/fd/N, /proc/<pid>/fd/N,
 * /proc/thread-self/fd/N, /dev/fd/N, /dev/stdin, /dev/stdout, /dev/stderr), with in *rest
 * what follows it ("" or "/..."); else -1. */
static int fd_path(const char *p, const char **rest) {
    const char *s;
    if (!strncmp(p, "/dev/", 5)) {
        static const char *const std[] = {"stdin", "stdout", "stderr"};
        s = p + 5;
        for (int i = 0; i < 3; i++) {
            size_t l = strlen(std[i]);
            if (!strncmp(s, std[i], l) && (s[l] == 0 || s[l] == '/')) { *rest = s + l; return i; }
        }
    } else if (!strncmp(p, "/proc/", 6)) {
        s = p + 6;
        if (!strncmp(s, "self/", 5)) s += 5;
        else if (!strncmp(s, "thread-self/", 12)) s += 12;
        else {
            char *end;
            long pid = strtol(s, &end, 10);
            if (*s < '0' || *s > '9' || *end != '/' || pid != (long)getpid()) return -1;
            s = end + 1;
        }
    } else {
        return -1;
    }
    if (strncmp(s, "fd/", 3) || s[3] < '0' || s[3] > '9') return -1;
    char *end;
    long fd = strtol(s + 3, &end, 10);
    if ((*end && *end != '/') || fd > INT_MAX) return -1;
    *rest = end;
    return (int)fd;
}

/* A path through a staged descriptor (/dev/stdin of `prog /dev/stdin < staged`): the
 * kernel would reopen the file behind it, the whole shard or the run's empty directory, so
 * it is the entry's, as it is on the plain tree. The magic link itself (not followed: lstat)
 * stays the kernel's. 1 if r is set. */
static int via_fd(Res *r, const char *path, int follow) {
    const char *rest;
    int fd = fd_path(path, &rest);
    Row row;
    if (fd < 0 || (!*rest && !follow) || !get_row(fd, &row)) return 0;
    r->entered = 1;
    if (*rest && row.kind != F_DIRFD) { r->kind = R_ERR; r->err = ENOTDIR; return 1; }
    walk(r, rest, row.e, follow);
    return 1;
}

/* Where (dirfd, path) lies: in the staged tree (an entry or an error), or outside it. */
static void resolve(Res *r, int dirfd, const char *path, int follow) {
    r->kind = R_REAL;
    r->path = path;
    if (!D.active || path == NULL) return;
    size_t n = strlen(path);
    if (path[0] == '/') {
        if ((path[1] == 'd' || path[1] == 'p') && via_fd(r, path, follow)) return;
        if (!starts_root(path, n) && !needs_walk(path)) return;  /* the fast path */
        walk(r, path, -1, follow);
        /* never in the tree: the kernel resolves the original (with the real symlinks) */
        if (r->kind == R_REAL && !r->entered) r->path = path;
        return;
    }
    if (dirfd != AT_FDCWD) {
        Row row;
        if (!get_row(dirfd, &row)) { resolve_below_real(r, dirfd, path, n, follow); return; }
        if (row.kind != F_DIRFD) { r->kind = R_ERR; r->err = ENOTDIR; return; }
        if (n == 0) { r->kind = R_STAGED; r->e = row.e; return; }
        walk(r, path, row.e, follow);
        return;
    }
    if (!vcwd[0]) {
        char cwd[PATH_MAX];
        pthread_mutex_lock(&cwd_lock);
        memcpy(cwd, rcwd, strlen(rcwd) + 1);
        pthread_mutex_unlock(&cwd_lock);
        if (!cwd[0] && (!strstr(path, "..") || !real_getcwd(cwd, sizeof cwd))) return;
        size_t cl = strlen(cwd);
        if (cl + 1 + n + 1 > PATH_MAX) return;
        char abs[PATH_MAX];
        memcpy(abs, cwd, cl); abs[cl] = '/'; memcpy(abs + cl + 1, path, n + 1);
        if (!starts_root(abs, cl + 1 + n) && !needs_walk(abs)) return;
        walk(r, abs, -1, follow);
        if (r->kind == R_REAL && !r->entered) r->path = path;
        return;
    }
    if (n == 0) { r->kind = R_ERR; r->err = ENOENT; return; }
    char abs[PATH_MAX];
    pthread_mutex_lock(&cwd_lock);
    size_t cl = strlen(vcwd);
    int ok = cl + 1 + n + 1 <= PATH_MAX;
    if (ok) { memcpy(abs, vcwd, cl); abs[cl] = '/'; memcpy(abs + cl + 1, path, n + 1); }
    pthread_mutex_unlock(&cwd_lock);
    if (!ok) { r->kind = R_ERR; r->err = ENAMETOOLONG; return; }
    walk(r, abs, -1, follow);  /* a real result is an absolute path: the real cwd is empty */
}

/* A path the kernel did not find (ENOENT) may still lead into the tree through a real
 * symlink outside it: ~/data -> /lustre/me/imagenet with --at /lustre/me/imagenet, which
 * need not exist on disk, so the kernel finds nothing behind the link. Resolve the path's
 * real symlinks as the kernel does (a readlink per component, ".." after a link from its
 * target), and if that reaches the root, resolve the rest in the tree: r becomes staged (or
 * the tree's error) and 1 is returned. Paid only after a real call failed with ENOENT;
 * otherwise errno is left as it was. */
static int via_link(Res *r, int dirfd, int follow) {
    if (errno != ENOENT || !D.active || r->kind != R_REAL || !r->path || !r->path[0]) return 0;
    char todo[PATH_MAX], done[PATH_MAX], next[PATH_MAX], target[PATH_MAX];
    size_t pl = strlen(r->path), bl = 0;
    if (r->path[0] != '/') {  /* relative to a real directory: its path first */
        if (dirfd == AT_FDCWD) {
            if (!real_getcwd(todo, sizeof todo)) goto no;
        } else {
            char link[32];
            snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd);
            ssize_t dl = real_readlinkat(AT_FDCWD, link, todo, sizeof todo - 1);
            if (dl <= 0 || todo[0] != '/') goto no;
            todo[dl] = 0;
        }
        bl = strlen(todo);
        if (bl + 1 + pl + 1 > sizeof todo) goto no;
        todo[bl++] = '/';
    }
    if (bl + pl + 1 > sizeof todo) goto no;
    memcpy(todo + bl, r->path, pl + 1);
    size_t dn = 0;
    done[0] = 0;
    int links = 0;
    const char *s = todo;
    for (;;) {
        while (*s == '/') s++;
        if (!*s) goto no;
        const char *c = s;
        while (*s && *s != '/') s++;
        size_t cl = (size_t)(s - c);
        if (cl == 1 && c[0] == '.') continue;
        if (cl == 2 && c[0] == '.' && c[1] == '.') { pop(done, &dn); continue; }
        if (push(done, &dn, c, cl) < 0) goto no;
        if (starts_root(done, dn)) {  /* in the tree: the rest is the tree's to resolve */
            if (dn + strlen(s) + 1 > sizeof next) goto no;
            memcpy(next, done, dn);
            memcpy(next + dn, s, strlen(s) + 1);
            Res in;
            walk(&in, next, -1, follow);
            if (in.kind == R_REAL) goto no;
            r->kind = in.kind; r->err = in.err; r->e = in.e; r->entered = 1;
            return 1;
        }
        const char *t = s;
        while (*t == '/') t++;
        if (!*t && !*s && !follow) goto no;  /* the last name, not followed */
        ssize_t n = real_readlinkat(AT_FDCWD, done, target, sizeof target - 1);
        /* not a link; or not on disk, as the root's parents need not be (lexical from here) */
        if (n < 0) { if (errno == EINVAL || errno == ENOENT) continue; goto no; }
        if (++links > MAX_LINKS || n == 0) goto no;
        target[n] = 0;
        if (target[0] == '/') { dn = 0; done[0] = 0; } else pop(done, &dn);
        if ((size_t)n + strlen(s) + 1 > sizeof next) goto no;
        memcpy(next, target, (size_t)n);
        memcpy(next + n, s, strlen(s) + 1);  /* s is empty or starts with '/' */
        memcpy(todo, next, strlen(next) + 1);
        s = todo;
    }
no:
    errno = ENOENT;
    return 0;
}

/* The absolute path of entry e under the root. */
static int entry_path(uint32_t e, char *out, size_t size) {
    size_t pl;
    const char *p = path_of(e, &pl);
    size_t need = D.root_len + (pl ? 1 + pl : 0) + 1;
    if (need > size) { errno = ERANGE; return -1; }
    memcpy(out, D.root, D.root_len);
    if (pl) { out[D.root_len] = '/'; memcpy(out + D.root_len + 1, p, pl); }
    out[need - 1] = 0;
    return 0;
}

/* ---- read counters (stagefs status) ----------------------------------------------------- */

/* The Store's format (tiers/status.py, docs/status.md): a file per process in the job's
 * stats directory, a 16-byte header ("SFSCNT1\n", the pid) and u64 slots, per holder
 * (memory, disk, peer, origin) its reads (samples) and bytes, and the origin's own reads
 * (fetched). The library counts what it
 * reads itself: a sample per open of a staged file held in a tier or read from the origin's
 * shard, and the bytes each read returns or mmap maps. Files the helper serves are
 * counted by the helper's Store. Each count is an atomic add to shared memory: nothing is lost when a process ends
 * or is killed. Made at the first count of each process (a forked child makes its own; an
 * exec'd program goes on in the file of its pid). */
enum { C_SLOTS = 30, C_SIZE = 16 + 8 * C_SLOTS, H_MEMORY = 0, H_DISK = 1, H_ORIGIN = 3,
       C_FETCHED = 12 /* fetched_reads, then fetched_bytes: the origin's own reads */,
       C_STORED = 14 /* stored_bytes: the bytes read as stored (the library reads raw files) */ };
static uint64_t *counts;
static int counts_state;  /* 0: not made in this process, 1: being made, 2: made, 3: failed */

static uint64_t *counters(void) {
    int st = __atomic_load_n(&counts_state, __ATOMIC_ACQUIRE);
    if (st == 2) return counts;
    int zero = 0;
    if (st != 0 || !D.stats_dir || !D.stats_dir[0] ||
        !__atomic_compare_exchange_n(&counts_state, &zero, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        return NULL;  /* another thread makes it now: this count is skipped */
    int saved = errno;
    char p[PATH_MAX];
    uint64_t *m = NULL;
    int n = snprintf(p, sizeof p, "%s/%d-preload.counters", D.stats_dir, (int)getpid());
    int fd = n > 0 && n < (int)sizeof p ?
        real_openat(AT_FDCWD, p, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600) : -1;
    struct stat st2;
    if (fd >= 0 && sys_fstat(fd, &st2) == 0) {
        char head[16] = "SFSCNT1\n";
        uint64_t pid = (uint64_t)getpid();
        memcpy(head + 8, &pid, 8);
        if ((st2.st_size >= C_SIZE || ftruncate(fd, C_SIZE) == 0) && pwrite(fd, head, 16, 0) == 16) {
            void *mm = real_mmap(NULL, C_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            if (mm != MAP_FAILED) m = (uint64_t *)((char *)mm + 16);
        }
    }
    if (fd >= 0) real_close(fd);
    errno = saved;
    counts = m;
    __atomic_store_n(&counts_state, m ? 2 : 3, __ATOMIC_RELEASE);
    return m;
}

/* src -1: no holder (an empty file, which the manifest in memory answers: memory's, as the
 * Store counts it) */
static int holder_of(int src) {
    if (src < 0) return H_MEMORY;
    return src < (int)D.ntiers ? (D.tier_kinds[src] == 'm' ? H_MEMORY : H_DISK) : H_ORIGIN;
}

static void count_read(int src, uint64_t samples, uint64_t nbytes) {
    uint64_t *c = counters();
    if (!c) return;
    int h = holder_of(src);
    if (samples) __atomic_add_fetch(&c[2 * h], samples, __ATOMIC_RELAXED);
    if (nbytes) {
        __atomic_add_fetch(&c[2 * h + 1], nbytes, __ATOMIC_RELAXED);
        __atomic_add_fetch(&c[C_STORED], nbytes, __ATOMIC_RELAXED);
    }
    if (nbytes && h == H_ORIGIN) {  /* a read of the origin's shard: the hit rate's count */
        __atomic_add_fetch(&c[C_FETCHED], 1, __ATOMIC_RELAXED);
        __atomic_add_fetch(&c[C_FETCHED + 1], nbytes, __ATOMIC_RELAXED);
    }
}

/* ---- the helper ------------------------------------------------------------------------- */

/* Send one request line; with want_fd, receive a status byte (0, or an errno value) and a
 * descriptor. -1 with errno when the helper cannot be reached or says no. */
static int helper(const char *req, int want_fd, int cloexec) {
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0) return -1;
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    strncpy(a.sun_path, D.socket_path, sizeof a.sun_path - 1);
    int fd = -1, err = EIO;
    size_t len = strlen(req);
    if (connect(s, (struct sockaddr *)&a, sizeof a) != 0 || send(s, req, len, MSG_NOSIGNAL) != (ssize_t)len)
        goto out;
    if (!want_fd) { fd = 0; goto out; }
    char status = 0;
    char cbuf[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {.iov_base = &status, .iov_len = 1};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
                       .msg_controllen = sizeof cbuf};
    ssize_t got;
    do got = recvmsg(s, &m, cloexec ? MSG_CMSG_CLOEXEC : 0); while (got < 0 && errno == EINTR);
    if (got != 1) goto out;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) memcpy(&fd, CMSG_DATA(c), sizeof fd);
    if (status != 0) {
        if (fd >= 0) real_close(fd);
        fd = -1;
        err = (unsigned char)status;
    }
out:
    real_close(s);
    if (fd < 0) errno = err;
    return fd;
}

/* The helper's memfd m made what an open(O_RDONLY) of a real file gives: write fails with
 * EBADF, a shared writable mapping with EACCES, F_GETFL says O_RDONLY (the helper wrote it,
 * so it came open for writing). Sealed first (the helper makes it with MFD_ALLOW_SEALING),
 * so that its bytes never change, whoever reopens it; then a read-only reopen through
 * /proc takes m's number (dup3: no other thread can take it in between). Without /proc, or
 * where /proc names another file, m stays sealed: a write fails with EPERM instead. */
static int read_only(int m, int cloexec) {
    int saved = errno;
    real_fcntl(m, F_ADD_SEALS, F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE);
    char p[64];
    snprintf(p, sizeof p, "/proc/self/fd/%d", m);
    int ro = real_openat(AT_FDCWD, p, O_RDONLY | O_NOCTTY | O_CLOEXEC);
    struct stat a, b;
    if (ro >= 0 && sys_fstat(m, &a) == 0 && sys_fstat(ro, &b) == 0 && a.st_dev == b.st_dev &&
        a.st_ino == b.st_ino)
        real_dup3(ro, m, cloexec ? O_CLOEXEC : 0);
    if (ro >= 0) real_close(ro);
    errno = saved;
    return m;
}

/* A read-only memfd holding entry e's verified bytes, from the helper (the Store's read
 * path). Every descriptor the helper gives comes through here. */
static int helper_file(uint32_t e, int cloexec) {
    char req[64];
    snprintf(req, sizeof req, "open %u\n", e);
    int m = helper(req, 1, cloexec);
    return m < 0 ? m : read_only(m, cloexec);
}

/* Ask the helper to place a shard in the tiers (once per shard per process). */
static void touch_shard(uint32_t shard) {
    if (!D.ntiers || !touched || shard >= D.nshards || __atomic_exchange_n(&touched[shard], 1, __ATOMIC_RELAXED))
        return;
    char req[64];
    snprintf(req, sizeof req, "place %u\n", shard);
    int saved = errno;
    helper(req, 0, 1);
    errno = saved;
}

/* ---- verified reads --------------------------------------------------------------------- */

static ssize_t pread_full(int fd, void *buf, size_t len, uint64_t off) {
    size_t done = 0;
    while (done < len) {
        ssize_t got = real_pread(fd, (char *)buf + done, len - done, (off_t)(off + done));
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) return -1;
        if (got == 0) break;
        done += (size_t)got;
    }
    return (ssize_t)done;
}

enum { V_OK = 0, V_BAD = 1, V_IO = 2 };

/* A row of a large file whose pieces the helper reads (see open_entry). */
static int by_helper(const Row *r) { return r->src == D.ntiers + 1; }

/* Piece k of entry e (ul bytes) into b, from the helper: the Store's read of it (the tiers'
 * copies, whole or partial, then the origin, placing what it reads), verified and counted
 * there. 0, or -1 if the helper cannot be reached or has no good bytes. */
static int helper_piece(uint32_t e, uint64_t k, char *b, uint64_t ul) {
    char req[64];
    snprintf(req, sizeof req, "piece %u %llu\n", e, (unsigned long long)k);
    int m = helper(req, 1, 1);
    if (m < 0) return -1;
    ssize_t got = pread_full(m, b, ul, 0);
    real_close(m);
    return got == (ssize_t)ul ? 0 : -1;
}

/* Marks of what this process verified on each source: a piece, or a file checked whole.
 * Set once its hash matched (tier copies are written once, renamed into place and never
 * changed); a later read of it is a plain pread. */
static uint8_t *marks(uint8_t **slot, uint64_t n) {
    uint8_t *m = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if (m || n == 0) return m;
    m = real_mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return NULL;
    uint8_t *none = NULL;
    if (!__atomic_compare_exchange_n(slot, &none, m, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        munmap(m, n);
        m = none;
    }
    return m;
}

static int marked(const uint8_t *m, uint64_t i) { return m && __atomic_load_n(&m[i], __ATOMIC_ACQUIRE); }
static void mark(uint8_t *m, uint64_t i) { if (m) __atomic_store_n(&m[i], 1, __ATOMIC_RELEASE); }

/* The unit a file is verified in: its pieces (1 MiB), or the whole file when it has none. */
typedef struct {
    uint64_t size;       /* of a unit; the last one may be shorter */
    uint64_t first;      /* the index of the file's first unit in marks and sums */
    const uint64_t *sums;
    uint8_t *marks;
    uint64_t key;        /* the scratch key of the first unit (a unit's bytes, whoever reads them) */
} Units;

static Units units_of(const Row *r) {
    uint32_t e = r->e, fp = D.piece ? D.piece[e] : NONE;
    int s = by_helper(r) ? (int)D.ntiers : r->src;  /* its descriptor is the origin's shard */
    if (fp != NONE)
        return (Units){D.piece_size, fp, D.pieces, marks(&vpiece[s], D.npieces), 2 * (uint64_t)fp + 2};
    return (Units){D.size[e] ? D.size[e] : 1, e, D.checksum, marks(&vfile[s], D.n), 2 * (uint64_t)e + 1};
}

/* Each thread keeps the last unit it verified whole for a read that wanted part of it: cat
 * reads 128 KiB at a time and stdio 64 KiB, so the rest of a 1 MiB piece (or of a small file)
 * comes from this copy, still in the CPU's cache, not from the tier again. Its bytes are the
 * ones hashed. A unit larger than SCRATCH_KEEP, or one read while the thread's buffer is in
 * use (a signal handler that reads, interrupting a read), goes through a mapping of its own,
 * unmapped at once (mmap and munmap, unlike malloc, may be called from a handler). */
enum { SCRATCH_KEEP = 8 << 20 };
static __thread struct { char *buf; size_t cap; uint64_t key; int busy; } scratch;
static pthread_key_t scratch_owner;  /* frees a thread's buffer when the thread ends */

static void scratch_free(void *buf) { free(buf); }

/* Does the thread's buffer hold the unit with this key, for the read that owns it? */
static int held(uint64_t key) { return scratch.busy == 1 && scratch.key == key; }

/* A buffer for n bytes: the thread's (grown if need be), or one of its own in *owned.
 * Page aligned: the kernel's copy into it and the copies out of it run at full speed (a
 * buffer 16 bytes off a page boundary, as malloc gives, read pieces at half the speed). */
static char *scratch_buf(size_t n, char **owned) {
    *owned = NULL;
    if (scratch.busy == 1 && scratch.cap >= n) return scratch.buf;
    if (scratch.busy > 1 || n > SCRATCH_KEEP) {
        char *m = real_mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        return m == MAP_FAILED ? NULL : (*owned = m);
    }
    void *b = NULL;
    if (posix_memalign(&b, 4096, n) != 0) return NULL;
    free(scratch.buf);
    pthread_setspecific(scratch_owner, b);
    scratch.buf = b;
    scratch.cap = n;
    scratch.key = 0;
    return b;
}

/* Unit k of the file ([us, us+ul) of it) verified whole in a buffer: a pointer to its bytes
 * (the thread's buffer, or *owned, to be unmapped after use), or NULL with V_BAD / V_IO in
 * *v. via: the helper's read of the piece (by_helper), the descriptor's if that fails.
 * Called with the thread's buffer marked busy. */
static const char *unit_verified(int fd, const Row *r, const Units *u, uint64_t k, uint64_t us,
                                 uint64_t ul, char **owned, int *v, int via) {
    uint64_t key = u->key + 2 * k;
    *owned = NULL;
    if (held(key)) return scratch.buf;
    char *b = scratch_buf(ul, owned);
    if (!b) { errno = ENOMEM; *v = V_IO; return NULL; }
    if (!*owned) scratch.key = 0;
    int got = via && helper_piece(r->e, k, b, ul) == 0;
    if (!got && pread_full(fd, b, ul, r->base + us) == (ssize_t)ul) {
        got = 1;
        if (via) count_read((int)D.ntiers, 0, ul);  /* the origin's, the helper unreachable */
    }
    if (!got || xxh3_64(b, ul) != u->sums[u->first + k]) {
        if (*owned) munmap(*owned, ul);
        *owned = NULL;
        *v = V_BAD;
        return NULL;
    }
    if (!via) mark(u->marks, u->first + k);  /* the helper's bytes: not the descriptor's */
    if (!*owned) scratch.key = key;
    return b;
}

/* The bytes [lo, hi) of the file were just read into out (at out + lo - pos): hash each unit
 * among them this process has not verified yet (the caller saw to it that each such unit
 * lies whole in [lo, hi); marks are never cleared, so one unmarked now was unmarked then). */
static int verify_run(const Units *u, const char *out, uint64_t pos, uint64_t size, uint64_t lo,
                      uint64_t hi) {
    for (uint64_t k = lo / u->size; k * u->size < hi; k++) {
        if (marked(u->marks, u->first + k)) continue;
        uint64_t us = k * u->size, ul = size - us < u->size ? size - us : u->size;
        if (xxh3_64(out + (us - pos), ul) != u->sums[u->first + k]) return V_BAD;
        mark(u->marks, u->first + k);
    }
    return V_OK;
}

/* Copy [pos, pos+len) of file r->e (a raw file in a shard, len clipped to its size) from
 * fd to out (NULL: verify only), every byte verified before it is returned, each unit once
 * per process. One pread brings every unit the read wants whole straight into out, where it
 * is hashed (the bytes returned are the ones hashed); a unit wanted in part is verified whole
 * in the scratch buffer and copied from there. V_BAD: the source disagrees with the
 * checksums (or is short); out then holds no bytes of it that a caller may use. */
static int vread_units(int fd, const Row *r, char *out, uint64_t pos, size_t len) {
    uint64_t size = D.size[r->e], end = pos + len;
    Units u = units_of(r);
    uint64_t run = pos;  /* the start of the bytes still to pread straight into out */
    int v = V_OK;
    int via = out && by_helper(r);  /* each piece from the helper, through the thread's buffer */
    for (uint64_t k = pos / u.size; k * u.size < end; k++) {
        uint64_t us = k * u.size, ul = size - us < u.size ? size - us : u.size;
        uint64_t lo = pos > us ? pos : us, hi = end < us + ul ? end : us + ul;
        int whole = lo == us && hi == us + ul;
        if (out && !via && (whole || marked(u.marks, u.first + k)) && !held(u.key + 2 * k))
            continue;  /* part of the run */
        if (out && run < lo) {  /* the run before this unit: pread, then verify its units */
            if (pread_full(fd, out + (run - pos), lo - run, r->base + run) != (ssize_t)(lo - run) ||
                verify_run(&u, out, pos, size, run, lo) != V_OK) return V_BAD;
        }
        run = hi;
        if (!out && marked(u.marks, u.first + k)) continue;
        char *owned;
        const char *b = unit_verified(fd, r, &u, k, us, ul, &owned, &v, via);
        if (!b) return v;
        if (out) memcpy(out + (lo - pos), b + (lo - us), hi - lo);
        if (owned) munmap(owned, ul);
    }
    if (out && run < end &&
        (pread_full(fd, out + (run - pos), end - run, r->base + run) != (ssize_t)(end - run) ||
         verify_run(&u, out, pos, size, run, end) != V_OK)) return V_BAD;
    return V_OK;
}

static int vread(int fd, const Row *r, char *out, uint64_t pos, size_t len) {
    if (len == 0) return V_OK;
    scratch.busy++;  /* 1: this read owns the thread's buffer; more: a handler's read in it */
    int v = vread_units(fd, r, out, pos, len);
    scratch.busy--;
    return v;
}

/* The copy behind fd failed its checksum: put the helper's verified copy in its place
 * (same number, same close-on-exec, same position). -1 with errno (EIO) if none. */
static int replace_with_helper(int fd, Row *r) {
    int fdflags = real_fcntl(fd, F_GETFD);
    off_t cur = real_lseek(fd, 0, SEEK_CUR);
    int m = helper_file(r->e, 1);
    if (m < 0) { errno = EIO; return -1; }
    if (real_dup3(m, fd, (fdflags & FD_CLOEXEC) ? O_CLOEXEC : 0) < 0) { real_close(m); return -1; }
    real_close(m);
    uint64_t pos = cur >= 0 && (uint64_t)cur >= r->base ? (uint64_t)cur - r->base : 0;
    real_lseek(fd, (off_t)pos, SEEK_SET);
    if (make_row(fd, F_MEM, r->e, 0, 0) < 0) return -1;
    get_row(fd, r);
    return 0;
}

/* pread of a staged shard file at file position pos. */
static ssize_t shard_pread(int fd, Row *r, void *buf, size_t n, uint64_t pos) {
    uint64_t size = D.size[r->e];
    if (pos >= size || n == 0) return 0;
    size_t len = n < size - pos ? n : (size_t)(size - pos);
    int v = vread(fd, r, buf, pos, len);
    if (v == V_OK) {
        if (!by_helper(r)) count_read(r->src, 0, len);  /* else the helper's Store counted it */
        return (ssize_t)len;
    }
    if (v == V_BAD && replace_with_helper(fd, r) == 0) return real_pread(fd, buf, n, (off_t)pos);
    int err = errno;
    memset(buf, 0, len);  /* what the failed read left there was not verified */
    errno = err;
    return -1;
}

/* ---- init ------------------------------------------------------------------------------- */

static int read_whole(const char *path, char **out, size_t *len) {
    int fd = (int)syscall(SYS_openat, AT_FDCWD, path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    struct stat st;
    if (sys_fstat(fd, &st) != 0) { syscall(SYS_close, fd); return -1; }
    char *b = malloc((size_t)st.st_size + 1);
    if (!b) { syscall(SYS_close, fd); return -1; }
    size_t done = 0;
    while (done < (size_t)st.st_size) {
        ssize_t got = syscall(SYS_pread64, fd, b + done, (size_t)st.st_size - done, (off_t)done);
        if (got <= 0) break;
        done += (size_t)got;
    }
    syscall(SYS_close, fd);
    b[done] = 0;
    *out = b; *len = done;
    return 0;
}

static uint64_t le(const char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static uint32_t le4(const char *p) { uint32_t v; memcpy(&v, p, 4); return v; }

static void warn(const char *fmt, const char *a) {
    char msg[1024];
    int n = snprintf(msg, sizeof msg, "stagefs preload: ");
    n += snprintf(msg + n, sizeof msg - (size_t)n, fmt, a);
    if (n > (int)sizeof msg - 2) n = (int)sizeof msg - 2;
    msg[n++] = '\n';
    ssize_t ignored = syscall(SYS_write, 2, msg, (size_t)n);
    (void)ignored;
}

static int load(const char *sidecar) {
    char *b; size_t blen;
    if (read_whole(sidecar, &b, &blen) != 0) { warn("cannot read %s: the staged path is not served", sidecar); return -1; }
    if (blen < SIDECAR_HEAD || memcmp(b, "STGFSPLD", 8) != 0 || le4(b + 8) != 2) {
        warn("%s is not a preload index of this stagefs: the staged path is not served", sidecar);
        return -1;
    }
    uint32_t flags = le4(b + 12);
    D.n = le(b + 16); D.piece_size = le(b + 24); D.dev = le(b + 32);
    uint64_t mlen = le(b + 40), msum = le(b + 48);
    D.nshards = le4(b + 56); D.ntiers = le4(b + 60);
    D.direct = flags & 1;
    uint64_t off[N_ARRAYS], cnt[N_ARRAYS];
    for (int i = 0; i < N_ARRAYS; i++) { off[i] = le(b + 64 + 16 * i); cnt[i] = le(b + 72 + 16 * i); }
    char *s = b + SIDECAR_HEAD, *end = b + blen;
    char *fields[7];
    for (int i = 0; i < 7; i++) { if (s >= end) goto bad; fields[i] = s; s += strlen(s) + 1; }
    D.root = fields[0]; D.root_len = strlen(D.root);
    D.socket_path = fields[2]; D.empty_dir = fields[3]; D.origin_dir = fields[4];
    D.stats_dir = fields[5]; D.tier_kinds = fields[6];
    if (D.ntiers >= MAX_SOURCES) D.ntiers = MAX_SOURCES - 1;
    if (strlen(D.tier_kinds) < D.ntiers) goto bad;
    D.tier_dirs = calloc(D.ntiers + 1, sizeof(char *));
    D.shard_names = calloc(D.nshards + 1, sizeof(char *));
    if (!D.tier_dirs || !D.shard_names) goto bad;
    for (uint32_t i = 0; i < D.ntiers; i++) { if (s >= end) goto bad; D.tier_dirs[i] = s; s += strlen(s) + 1; }
    for (uint32_t i = 0; i < D.nshards; i++) { if (s >= end) goto bad; D.shard_names[i] = s; s += strlen(s) + 1; }
    /* the manifest, mapped; its header must be the one the sidecar was written from */
    int fd = (int)syscall(SYS_openat, AT_FDCWD, fields[1], O_RDONLY | O_CLOEXEC);
    if (fd < 0) { warn("cannot open the manifest %s", fields[1]); return -1; }
    struct stat st;
    if (sys_fstat(fd, &st) != 0 || (uint64_t)st.st_size != mlen) { syscall(SYS_close, fd); goto changed; }
    const char *m = real_mmap(NULL, mlen, PROT_READ, MAP_SHARED, fd, 0);
    syscall(SYS_close, fd);
    if (m == MAP_FAILED) goto changed;
    if (le(m + 32) != mlen || le(m + 40) != msum) goto changed;
    static const uint8_t width[N_ARRAYS] = {8, 8, 4, 1, 4, 8, 8, 4, 8, 8, 1, 8, 4, 4, 4, 4, 1, 8};
    for (int i = 0; i < N_ARRAYS; i++)
        if (cnt[i] && (off[i] > mlen || cnt[i] > (mlen - off[i]) / width[i])) goto bad;
#define ARR(name, i, type) D.name = cnt[i] ? (const type *)(m + off[i]) : NULL
    ARR(path_off, A_PATH_OFF, uint64_t); ARR(hash, A_HASH, uint64_t); ARR(parent, A_PARENT, uint32_t);
    ARR(kind, A_KIND, uint8_t); ARR(mode, A_MODE, uint32_t); ARR(mtime, A_MTIME, int64_t);
    ARR(size, A_SIZE, uint64_t); ARR(shard, A_SHARD, uint32_t); ARR(offset, A_OFFSET, uint64_t);
    ARR(stored, A_STORED, uint64_t); ARR(codec, A_CODEC, uint8_t); ARR(checksum, A_CHECKSUM, uint64_t);
    ARR(first, A_FIRST, uint32_t); ARR(count, A_COUNT, uint32_t); ARR(piece, A_PIECE, uint32_t);
    ARR(slots, A_SLOTS, uint32_t); ARR(strings, A_STRINGS, uint8_t); ARR(pieces, A_PIECES, uint64_t);
#undef ARR
    D.nslots = cnt[A_SLOTS]; D.npieces = cnt[A_PIECES]; D.nstrings = cnt[A_STRINGS];
    if (!D.path_off || !D.slots || !D.strings || D.n == 0 || D.nslots <= D.n ||
        (D.nslots & (D.nslots - 1)) || cnt[A_PATH_OFF] != D.n + 1) goto bad;
    if (!D.pieces) D.piece = NULL;
    D.sidecar_path = strdup(sidecar);
    return 0;
changed:
    warn("the manifest %s changed since 'stagefs run' started: the staged path is not served", fields[1]);
    return -1;
bad:
    warn("%s is malformed: the staged path is not served", sidecar);
    return -1;
}

static void restore_fds(const char *spec) {
    /* "fd,kind,entry,base,src,dev,ino;" for each staged descriptor this process inherited */
    const char *p = spec;
    while (p && *p) {
        unsigned long long v[7];
        int used = 0;
        if (sscanf(p, "%llu,%llu,%llu,%llu,%llu,%llu,%llu;%n", &v[0], &v[1], &v[2], &v[3], &v[4],
                   &v[5], &v[6], &used) != 7 || used == 0) break;
        p += used;
        int fd = (int)v[0];
        struct stat st;
        if (fd < 0 || fd >= max_fd || v[2] >= D.n || sys_fstat(fd, &st) != 0 ||
            (uint64_t)st.st_dev != v[5] || (uint64_t)st.st_ino != v[6]) continue;
        Row r = {.kind = (uint8_t)v[1], .e = (uint32_t)v[2], .base = v[3], .src = (uint8_t)v[4],
                 .dev = v[5], .ino = v[6]};
        set_row(fd, &r);
    }
}

static FILE *cookie_file(int fd, const char *mode);

/* A staged file inherited as standard input: glibc's stdin reads fd 0 with its internal read,
 * which no preload sees (it would return the shard's bytes), so stdin becomes a stream that
 * reads through the wrappers (same descriptor, same shared position). */
static void serve_stdin(void) {
    Row r;
    if (!get_row(0, &r) || r.kind != F_SHARD) return;
    FILE *f = cookie_file(0, "r");
    if (f) stdin = f;
}

static void after_fork_child(void) {
    owner = getpid();  /* a forked child has memory of its own */
    kid.n = 0;
    counts = NULL;
    counts_state = 0;  /* the child counts in a file of its own */
    pthread_mutex_init(&lock, NULL);
    pthread_mutex_init(&cwd_lock, NULL);
    /* a row another thread was writing at the fork stays half written: that thread is not
     * in the child, and the descriptor it opened or closed was not handed to the program */
    for (int fd = 0; rows && fd <= top_fd && fd < max_fd; fd++)
        if (rows[fd].seq & 1) { rows[fd].kind = F_NONE; rows[fd].seq++; }
}

static pthread_once_t once = PTHREAD_ONCE_INIT;
static void leave(void);

static void init(void) {
    resolve_real();
    D.page = sysconf(_SC_PAGESIZE);
    const char *sidecar = getenv("STAGEFS_PRELOAD_INDEX");
    if (!sidecar || !*sidecar) return;
    if (load(sidecar) != 0) return;
    struct rlimit rl;
    max_fd = getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_max != RLIM_INFINITY ? (int)rl.rlim_max : 1 << 20;
    if (max_fd > 1 << 20) max_fd = 1 << 20;
    if (max_fd < 1024) max_fd = 1024;
    rows = real_mmap(NULL, (size_t)max_fd * sizeof(Row), PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (rows == MAP_FAILED) { warn("%s", "no memory for the descriptor table: not served"); return; }
    touched = calloc(D.nshards + 1, 1);
    owner = getpid();
    D.uid = getuid(); D.gid = getgid();
    Dl_info info;
    if (dladdr((void *)&init, &info) && info.dli_fname) D.self_path = strdup(info.dli_fname);
    pthread_atfork(NULL, NULL, after_fork_child);
    pthread_key_create(&scratch_owner, scratch_free);
    D.active = 1;
    restore_fds(getenv("STAGEFS_PRELOAD_FDS"));
    serve_stdin();
    /* the current directory: inherited from a parent inside the tree, or started inside */
    const char *c = getenv("STAGEFS_PRELOAD_CWD");
    char here[PATH_MAX];
    if (real_getcwd(here, sizeof here)) {
        if (c && *c && strcmp(here, D.empty_dir) == 0 && strlen(c) < sizeof vcwd) {
            strcpy(vcwd, c);
        } else if (starts_root(here, strlen(here))) {
            Res r;
            walk(&r, here, -1, 1);
            if (r.kind == R_STAGED && D.kind[r.e] == K_DIR) {
                entry_path(r.e, vcwd, sizeof vcwd);
                real_chdir(D.empty_dir);
            }
        }
    }
    if (!vcwd[0]) leave();
}

__attribute__((constructor)) static void ctor(void) { pthread_once(&once, init); }
#define INIT() pthread_once(&once, init)

/* ---- open and close --------------------------------------------------------------------- */

#define WRITE_FLAGS (O_WRONLY | O_RDWR | O_CREAT | O_TRUNC | O_APPEND)

/* dir/name into out (PATH_MAX bytes); -1 if too long. */
static int join(char *out, const char *dir, const char *name) {
    size_t d = strlen(dir), n = strlen(name);
    if (d + 1 + n + 1 > PATH_MAX) return -1;
    memcpy(out, dir, d);
    out[d] = '/';
    memcpy(out + d + 1, name, n + 1);
    return 0;
}

/* Open a shard file holding entry e's bytes: a tier's copy, else (with origin) the origin's. */
static int open_shard(uint32_t e, int cloexec, int *src, int origin) {
    uint32_t sh = D.shard[e];
    if (sh >= D.nshards) return -1;
    char p[PATH_MAX];
    int fl = O_RDONLY | (cloexec ? O_CLOEXEC : 0);
    for (uint32_t t = 0; t < D.ntiers; t++) {
        if (join(p, D.tier_dirs[t], D.shard_names[sh]) != 0) continue;
        int fd = real_openat(AT_FDCWD, p, fl);
        if (fd >= 0) { *src = (int)t; return fd; }
    }
    if (!origin) return -1;
    if (!D.origin_dir[0] || join(p, D.origin_dir, D.shard_names[sh]) != 0) return -1;
    int fd = real_openat(AT_FDCWD, p, fl);
    if (fd >= 0) { *src = (int)D.ntiers; touch_shard(sh); }
    return fd;
}

/* The largest file the helper copies whole into a memfd for a reader (below). */
#define HELPER_COPY_MAX (64u << 20)

static int open_entry(uint32_t e, int flags) {
    int cloexec = (flags & O_CLOEXEC) != 0;
    if (D.kind[e] == K_DIR || (flags & O_PATH && D.kind[e] != K_FILE)) {
        int fd = real_openat(AT_FDCWD, D.empty_dir, O_RDONLY | O_DIRECTORY | (cloexec ? O_CLOEXEC : 0));
        if (fd < 0) return -1;
        return make_row(fd, F_DIRFD, e, 0, 0);
    }
    if (flags & O_DIRECTORY) { errno = ENOTDIR; return -1; }
    if (D.kind[e] != K_FILE) { errno = ELOOP; return -1; }  /* O_NOFOLLOW on a link */
    if (flags & O_PATH) {  /* the file's name only (fstat, *at calls): no byte read or readable */
        int fd = real_openat(AT_FDCWD, D.empty_dir, O_PATH | O_DIRECTORY | (cloexec ? O_CLOEXEC : 0));
        return fd < 0 ? -1 : make_row(fd, F_DIRFD, e, 0, 0);
    }
    if (D.direct && D.codec[e] == 0 && (D.piece || D.size[e] <= D.piece_size || D.size[e] <= (64u << 20))) {
        int src = 0;
        /* a file larger than HELPER_COPY_MAX is read from the origin's shard (piece by
         * piece, each verified) while its shard is not whole in a tier: the helper hands a
         * file over whole in a memfd, and a 1.1 GB file cost 1.1 GB of memory and 5 s for
         * each open, however few of its bytes the program read */
        int fd = open_shard(e, cloexec, &src, !D.ntiers || D.size[e] > HELPER_COPY_MAX);
        if (fd < 0 && D.ntiers) {
            /* not whole in a tier: the helper reads it through the Store, where reads and
             * the streams that place its shard share one download from the origin, and
             * partial copies serve the pieces they hold (the origin's shard is not even
             * opened here: an open on the shared file system is a metadata operation);
             * the origin's shard directly only if the helper cannot be reached */
            int m = helper_file(e, cloexec);
            if (m >= 0) return make_row(m, F_MEM, e, 0, 0);
            fd = open_shard(e, cloexec, &src, 1);
        }
        if (fd >= 0) {
            if (real_lseek(fd, (off_t)D.offset[e], SEEK_SET) < 0) { real_close(fd); return -1; }
            /* a large file on the origin's shard with tiers: its pieces are read through the
             * helper (the descriptor keeps the position and serves mmap), so the pieces a
             * tier holds (a partial copy, a shard split between tiers) are read there, and
             * those it does not are read from the origin once, by the Store that also places
             * them (read from the shard here, each epoch read the whole file from the
             * origin, and the first read it twice, once more for the tiers) */
            if (src == (int)D.ntiers && D.ntiers && D.piece && D.piece[e] != NONE) src = (int)D.ntiers + 1;
            int r = make_row(fd, F_SHARD, e, D.offset[e], src);
            /* a sample (the helper's Store counts one at the read of the first piece) */
            if (r >= 0 && src <= (int)D.ntiers) count_read(D.size[e] ? src : -1, 1, 0);
            return r;
        }
    }
    int fd = helper_file(e, cloexec);
    if (fd < 0) return -1;
    return make_row(fd, F_MEM, e, 0, 0);
}

/* open/openat, for every variant. */
static int do_openat(int dirfd, const char *path, int flags, mode_t mode) {
    INIT();
    Res r;
    resolve(&r, dirfd, path, !(flags & O_NOFOLLOW));
    if (r.kind == R_REAL) {
        int fd = real_openat(dirfd, r.path, flags, mode);
        clear_row(fd);
        if (fd >= 0 || !via_link(&r, dirfd, !(flags & O_NOFOLLOW))) return fd;
    }
    if ((flags & WRITE_FLAGS) || (flags & O_TMPFILE) == O_TMPFILE) { errno = EROFS; return -1; }
    if (r.kind == R_ERR) { errno = r.err; return -1; }
    return open_entry(r.e, flags);
}

static mode_t mode_arg(int flags, va_list ap) {
    return ((flags & O_CREAT) || (flags & O_TMPFILE) == O_TMPFILE) ? (mode_t)va_arg(ap, int) : 0;
}

API int open(const char *path, int flags, ...) {
    va_list ap; va_start(ap, flags); mode_t m = mode_arg(flags, ap); va_end(ap);
    return do_openat(AT_FDCWD, path, flags, m);
}
API int open64(const char *path, int flags, ...) {
    va_list ap; va_start(ap, flags); mode_t m = mode_arg(flags, ap); va_end(ap);
    return do_openat(AT_FDCWD, path, flags, m);
}
API int openat(int dirfd, const char *path, int flags, ...) {
    va_list ap; va_start(ap, flags); mode_t m = mode_arg(flags, ap); va_end(ap);
    return do_openat(dirfd, path, flags, m);
}
API int openat64(int dirfd, const char *path, int flags, ...) {
    va_list ap; va_start(ap, flags); mode_t m = mode_arg(flags, ap); va_end(ap);
    return do_openat(dirfd, path, flags, m);
}
API int __open_2(const char *path, int flags) { return do_openat(AT_FDCWD, path, flags, 0); }
API int __open64_2(const char *path, int flags) { return do_openat(AT_FDCWD, path, flags, 0); }
API int __openat_2(int d, const char *path, int flags) { return do_openat(d, path, flags, 0); }
API int __openat64_2(int d, const char *path, int flags) { return do_openat(d, path, flags, 0); }
API int creat(const char *path, mode_t mode) { return do_openat(AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC, mode); }
API int creat64(const char *path, mode_t mode) { return do_openat(AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC, mode); }

API int close(int fd) {
    INIT();
    clear_row(fd);
    return real_close(fd);
}

API int close_range(unsigned lo, unsigned hi, int flags) {
    INIT();
    if (D.active && !(flags & CLOSE_RANGE_CLOEXEC))
        for (unsigned fd = lo; fd <= hi && fd < (unsigned)max_fd; fd++) clear_row((int)fd);
    return real_close_range ? real_close_range(lo, hi, flags) : (int)syscall(SYS_close_range, lo, hi, flags);
}

API void closefrom(int lo) { close_range((unsigned)lo, ~0u, 0); }

/* ---- dup -------------------------------------------------------------------------------- */

static int copy_row(int from, int to) {
    if (to < 0) return to;
    Row r;
    if (get_row(from, &r)) set_row(to, &r);
    else clear_row(to);
    return to;
}

API int dup(int fd) { INIT(); return copy_row(fd, real_dup(fd)); }
API int dup2(int fd, int to) { INIT(); int got = real_dup2(fd, to); return fd == to ? got : copy_row(fd, got); }
API int dup3(int fd, int to, int flags) { INIT(); return copy_row(fd, real_dup3(fd, to, flags)); }

static int do_fcntl(int fd, int cmd, va_list ap) {
    INIT();
    void *arg = va_arg(ap, void *);
    int got = real_fcntl(fd, cmd, arg);
    if (cmd == F_DUPFD || cmd == F_DUPFD_CLOEXEC) copy_row(fd, got);
    return got;
}
API int fcntl(int fd, int cmd, ...) { va_list ap; va_start(ap, cmd); int r = do_fcntl(fd, cmd, ap); va_end(ap); return r; }
API int fcntl64(int fd, int cmd, ...) { va_list ap; va_start(ap, cmd); int r = do_fcntl(fd, cmd, ap); va_end(ap); return r; }

/* ---- read ------------------------------------------------------------------------------- */

API ssize_t pread(int fd, void *buf, size_t n, off_t off) {
    INIT();
    Row r;
    if (!get_row(fd, &r) || r.kind != F_SHARD) return real_pread(fd, buf, n, off);
    if (off < 0) { errno = EINVAL; return -1; }
    return shard_pread(fd, &r, buf, n, (uint64_t)off);
}
API ssize_t pread64(int fd, void *buf, size_t n, off_t off) { return pread(fd, buf, n, off); }
API ssize_t __pread_chk(int fd, void *buf, size_t n, off_t off, size_t buflen) { (void)buflen; return pread(fd, buf, n, off); }
API ssize_t __pread64_chk(int fd, void *buf, size_t n, off_t off, size_t buflen) { (void)buflen; return pread(fd, buf, n, off); }

/* The file position of a staged shard descriptor (kept in the kernel, past base). */
static int64_t shard_pos(int fd, const Row *r) {
    off_t cur = real_lseek(fd, 0, SEEK_CUR);
    if (cur < 0) return -1;
    return (uint64_t)cur >= r->base ? (int64_t)((uint64_t)cur - r->base) : 0;
}

API ssize_t read(int fd, void *buf, size_t n) {
    INIT();
    Row r;
    if (!get_row(fd, &r) || r.kind != F_SHARD) return real_read(fd, buf, n);
    int64_t pos = shard_pos(fd, &r);
    if (pos < 0) return -1;
    ssize_t got = shard_pread(fd, &r, buf, n, (uint64_t)pos);
    if (got > 0) real_lseek(fd, (off_t)(r.base + (uint64_t)pos + (uint64_t)got), SEEK_SET);
    return got;
}
API ssize_t __read_chk(int fd, void *buf, size_t n, size_t buflen) { (void)buflen; return read(fd, buf, n); }

static ssize_t shard_preadv(int fd, Row *r, const struct iovec *iov, int cnt, uint64_t pos) {
    ssize_t total = 0;
    for (int i = 0; i < cnt; i++) {
        ssize_t got = shard_pread(fd, r, iov[i].iov_base, iov[i].iov_len, pos + (uint64_t)total);
        if (got < 0) return total ? total : -1;
        total += got;
        if ((size_t)got < iov[i].iov_len) break;
    }
    return total;
}

API ssize_t readv(int fd, const struct iovec *iov, int cnt) {
    INIT();
    Row r;
    if (!get_row(fd, &r) || r.kind != F_SHARD) return real_readv(fd, iov, cnt);
    int64_t pos = shard_pos(fd, &r);
    if (pos < 0) return -1;
    ssize_t got = shard_preadv(fd, &r, iov, cnt, (uint64_t)pos);
    if (got > 0) real_lseek(fd, (off_t)(r.base + (uint64_t)pos + (uint64_t)got), SEEK_SET);
    return got;
}

API ssize_t preadv(int fd, const struct iovec *iov, int cnt, off_t off) {
    INIT();
    Row r;
    if (!get_row(fd, &r) || r.kind != F_SHARD) return real_preadv(fd, iov, cnt, off);
    if (off < 0) { errno = EINVAL; return -1; }
    return shard_preadv(fd, &r, iov, cnt, (uint64_t)off);
}
API ssize_t preadv64(int fd, const struct iovec *iov, int cnt, off_t off) { return preadv(fd, iov, cnt, off); }

API ssize_t preadv2(int fd, const struct iovec *iov, int cnt, off_t off, int flags) {
    INIT();
    Row r;
    if (!get_row(fd, &r) || r.kind != F_SHARD) return real_preadv2(fd, iov, cnt, off, flags);
    if (off == -1) return readv(fd, iov, cnt);
    return preadv(fd, iov, cnt, off);
}
API ssize_t preadv64v2(int fd, const struct iovec *iov, int cnt, off_t off, int flags) { return preadv2(fd, iov, cnt, off, flags); }

/* lseek of a staged directory: the position getdents64 goes on from (a d_off it gave, or 0
 * to list it again), as on a real directory. */
static off_t dir_seek(int fd, const Row *r, off_t off, int whence) {
    int64_t pos = whence == SEEK_SET ? off : whence == SEEK_CUR ? (int64_t)r->dpos + off : -1;
    if (pos < 0) { errno = EINVAL; return -1; }
    row_begin(fd);
    if (rows[fd].kind == F_DIRFD && rows[fd].ino == r->ino)
        __atomic_store_n(&rows[fd].dpos, (uint64_t)pos, __ATOMIC_RELAXED);
    row_end(fd);
    return (off_t)pos;
}

API off_t lseek(int fd, off_t off, int whence) {
    INIT();
    Row r;
    if (!get_row(fd, &r)) return real_lseek(fd, off, whence);
    if (r.kind == F_DIRFD && D.kind[r.e] == K_DIR) return dir_seek(fd, &r, off, whence);
    if (r.kind != F_SHARD) return real_lseek(fd, off, whence);
    int64_t size = (int64_t)D.size[r.e], pos;
    switch (whence) {
    case SEEK_SET: pos = off; break;
    case SEEK_CUR: { int64_t cur = shard_pos(fd, &r); if (cur < 0) return -1; pos = cur + off; break; }
    case SEEK_END: pos = size + off; break;
    case SEEK_DATA: if (off < 0 || off >= size) { errno = ENXIO; return -1; } pos = off; break;
    case SEEK_HOLE: if (off < 0 || off >= size) { errno = ENXIO; return -1; } pos = size; break;
    default: errno = EINVAL; return -1;
    }
    if (pos < 0) { errno = EINVAL; return -1; }
    if (real_lseek(fd, (off_t)(r.base + (uint64_t)pos), SEEK_SET) < 0) return -1;
    return pos;
}
API off_t lseek64(int fd, off_t off, int whence) { return lseek(fd, off, whence); }

/* A staged source for copy_file_range / sendfile / splice: read through the wrappers,
 * write with the real write (the kernel would copy the shard's bytes unverified). */
static ssize_t copy_out(int in, off_t *inoff, int out, size_t n) {
    char buf[65536];
    size_t want = n < sizeof buf ? n : sizeof buf;
    ssize_t got = inoff ? pread(in, buf, want, *inoff) : read(in, buf, want);
    if (got <= 0) return got;
    ssize_t put = write(out, buf, (size_t)got);
    if (put < 0) return -1;
    if (inoff) *inoff += put;
    else if (put < got) lseek(in, put - got, SEEK_CUR);
    return put;
}

API ssize_t copy_file_range(int in, off_t *inoff, int out, off_t *outoff, size_t n, unsigned fl) {
    INIT();
    Row r;
    if (!get_row(in, &r) || r.kind != F_SHARD) return real_copy_file_range(in, inoff, out, outoff, n, fl);
    if (outoff) { errno = EXDEV; return -1; }  /* callers fall back to read and write */
    return copy_out(in, inoff, out, n);
}
API ssize_t sendfile(int out, int in, off_t *inoff, size_t n) {
    INIT();
    Row r;
    if (!get_row(in, &r) || r.kind != F_SHARD) return real_sendfile(out, in, inoff, n);
    return copy_out(in, inoff, out, n);
}
API ssize_t sendfile64(int out, int in, off_t *inoff, size_t n) { return sendfile(out, in, inoff, n); }
API ssize_t splice(int in, off_t *inoff, int out, off_t *outoff, size_t n, unsigned fl) {
    INIT();
    Row r;
    if (!get_row(in, &r) || r.kind != F_SHARD) return real_splice(in, inoff, out, outoff, n, fl);
    if (outoff) { errno = EINVAL; return -1; }
    return copy_out(in, inoff, out, n);
}

/* ---- mmap ------------------------------------------------------------------------------- */

/* Where the pieces of a large file read through the helper (by_helper: its shard is not
 * whole in a tier) are held, for a mapping of it: src[k] is t + 1 for a piece tier t's copy
 * of the shard holds (whole or partial: the helper says which pieces each copy holds,
 * written and checked) and that was checked here, read from fd[t]; 0 for a piece read from
 * the origin's shard. Mapped from the origin's shard whole, such a file was read from the
 * origin whole at each mapping (np.load(mmap_mode="r") of a large array, every epoch),
 * however much of it the tiers held, and counted no sample. */
typedef struct { int fd[MAX_SOURCES]; uint8_t *src; uint64_t n; } Held;

static int tier_copy(uint32_t t, uint32_t sh) {
    char p[PATH_MAX], q[PATH_MAX];
    if (join(p, D.tier_dirs[t], D.shard_names[sh]) != 0) return -1;
    int fd = real_openat(AT_FDCWD, p, O_RDONLY | O_CLOEXEC);  /* whole */
    if (fd >= 0 || snprintf(q, sizeof q, "%s.partial", p) >= (int)sizeof q) return fd;
    return real_openat(AT_FDCWD, q, O_RDONLY | O_CLOEXEC);
}

/* Fill h for pieces k0..k1-1 of r's file (nothing, h->src NULL, for another row, for no
 * piece, or when the helper cannot say): each piece a tier holds is checked against its
 * checksum there (one that fails is the origin's). */
static void held_open(Held *h, const Row *r, uint64_t k0, uint64_t k1) {
    uint32_t e = r->e, fp = D.piece ? D.piece[e] : NONE;
    uint64_t P = D.piece_size, size = D.size[e];
    h->src = NULL;
    h->n = (size + P - 1) / P;
    for (int t = 0; t < MAX_SOURCES; t++) h->fd[t] = -1;
    if (!by_helper(r) || fp == NONE || !h->n || k1 <= k0) return;
    char req[64];
    snprintf(req, sizeof req, "held %u\n", e);
    int m = helper(req, 1, 1);
    if (m < 0) return;
    uint8_t *src = real_mmap(NULL, h->n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    char *b = real_mmap(NULL, P, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    int ok = src != MAP_FAILED && b != MAP_FAILED && pread_full(m, (char *)src, h->n, 0) == (ssize_t)h->n;
    real_close(m);
    if (ok) {
        int tried[MAX_SOURCES] = {0};
        for (uint64_t k = 0; k < h->n; k++) {
            uint32_t t = (uint32_t)src[k] - 1;
            src[k] = 0;
            if (k < k0 || k >= k1 || t >= D.ntiers) continue;
            if (!tried[t]) { tried[t] = 1; h->fd[t] = tier_copy(t, D.shard[e]); }
            uint64_t us = k * P, ul = size - us < P ? size - us : P;
            if (h->fd[t] < 0) continue;
            if (pread_full(h->fd[t], b, ul, r->base + us) == (ssize_t)ul &&
                xxh3_64(b, ul) == D.pieces[fp + k])
                src[k] = (uint8_t)(t + 1);
            else  /* mapped from the origin; the helper's read of it finds the bad copy,
                   * counts it, drops it and logs it, as a read's would */
                helper_piece(e, k, b, ul);
        }
        h->src = src;
    } else if (src != MAP_FAILED) {
        munmap(src, h->n);
    }
    if (b != MAP_FAILED) munmap(b, P);
}

static void held_close(Held *h) {
    for (int t = 0; t < MAX_SOURCES; t++)
        if (h->fd[t] >= 0) real_close(h->fd[t]);
    if (h->src) munmap(h->src, h->n);
}

/* Check [pos, pos + cover) of r's file for a mapping, each piece where h says (h->src
 * NULL: every byte from r's descriptor), and count it by holder; V_OK, V_BAD or V_IO. */
static int held_verify(int fd, const Row *r, const Held *h, uint64_t pos, size_t cover) {
    if (!h->src) {
        int v = vread(fd, r, NULL, pos, cover);
        /* the bytes mapped were read and checked here, as a read's are: counted as a read's
         * (uncounted, np.load(mmap_mode="r") of a file showed a sample of no bytes) */
        if (v == V_OK) count_read(r->src, 0, cover);
        return v;
    }
    uint64_t P = D.piece_size, end = pos + cover, got[MAX_SOURCES + 2] = {0};
    for (uint64_t k = pos / P; k * P < end; k++) {
        uint64_t lo = pos > k * P ? pos : k * P, hi = end < (k + 1) * P ? end : (k + 1) * P;
        int s = h->src[k] ? h->src[k] - 1 : r->src;
        if (!h->src[k]) {
            int v = vread(fd, r, NULL, lo, hi - lo);
            if (v != V_OK) return v;
        }
        got[s] += hi - lo;
    }
    /* a sample for a mapping from the start, as the helper counts one for a read of the
     * first piece (the open of a file read through the helper counts none) */
    if (pos == 0 && cover) count_read(h->src[0] ? h->src[0] - 1 : r->src, 1, 0);
    for (int s = 0; s < MAX_SOURCES + 2; s++)
        if (got[s]) count_read(s, 0, got[s]);
    return V_OK;
}

/* Put the pieces h has in a tier over [pos, pos + full) of the mapping m of r's file (made
 * from the origin's shard): the tier copy's pages, mapped as the caller asked. 0, or -1
 * (errno EIO) if a piece could be mapped from neither. */
static int held_map(const Held *h, int fd, const Row *r, char *m, uint64_t pos, size_t full,
                    int prot, int flags) {
    uint64_t P = D.piece_size, end = pos + full;
    int fixed = (flags & ~MAP_FIXED_NOREPLACE) | MAP_FIXED;
    for (uint64_t k = pos / P; h->src && k * P < end; k++) {
        uint64_t lo = pos > k * P ? pos : k * P, hi = end < (k + 1) * P ? end : (k + 1) * P;
        if (!h->src[k] || hi <= lo) continue;
        if (real_mmap(m + (lo - pos), hi - lo, prot, fixed, h->fd[h->src[k] - 1],
                      (off_t)(r->base + lo)) != MAP_FAILED) continue;
        /* the origin's pages again (a failed MAP_FIXED may leave the range unmapped) */
        if (real_mmap(m + (lo - pos), hi - lo, prot, fixed, fd, (off_t)(r->base + lo)) == MAP_FAILED) {
            errno = EIO;
            return -1;
        }
    }
    return 0;
}

API void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
    INIT();
    Row r;
    if (flags & MAP_ANONYMOUS || !get_row(fd, &r) || r.kind != F_SHARD)
        return real_mmap(addr, len, prot, flags, fd, off);
    if ((prot & PROT_WRITE) && (flags & MAP_SHARED)) { errno = EACCES; return MAP_FAILED; }
    if (off < 0 || off % D.page) { errno = EINVAL; return MAP_FAILED; }
    uint64_t size = D.size[r.e], pos = (uint64_t)off;
    size_t avail = pos < size ? (size_t)(size - pos) : 0, cover = len < avail ? len : avail;
    int aligned = (r.base + pos) % (uint64_t)D.page == 0;
    Held h;
    /* a private copy of a file read through the helper: every piece from the helper (the
     * tier's or the origin's), verified and counted there (checked here from the origin
     * first, each piece no tier held was read from the origin twice, and counted twice) */
    held_open(&h, &r, pos / D.piece_size,
              aligned || !by_helper(&r) ? (pos + cover + D.piece_size - 1) / D.piece_size : 0);
    int v = aligned || !by_helper(&r) ? held_verify(fd, &r, &h, pos, cover) : V_OK;
    if (v != V_OK) held_close(&h);
    if (v == V_IO) return MAP_FAILED;
    if (v == V_BAD) {
        if (replace_with_helper(fd, &r) < 0) return MAP_FAILED;
        return real_mmap(addr, len, prot, flags, fd, off);
    }
    if (aligned) {  /* the tier's pages themselves: no copy */
        char *m = real_mmap(addr, len, prot, flags, fd, (off_t)(r.base + pos));
        size_t full = cover / (size_t)D.page * (size_t)D.page;
        int bad = m != MAP_FAILED && held_map(&h, fd, &r, m, pos, full, prot, flags) != 0;
        held_close(&h);
        if (bad) { munmap(m, len); return MAP_FAILED; }
        if (m == MAP_FAILED || full >= len) return m;
        /* the last page holds the next file's bytes in the shard: a private page with the
         * file's tail and zeros after it, as a real file's mapping shows */
        char *tail = m + full;
        if (real_mmap(tail, len - full, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == MAP_FAILED ||
            vread(fd, &r, tail, pos + full, cover - full) != V_OK ||
            (!(prot & PROT_WRITE) && mprotect(tail, len - full, prot) != 0)) {
            munmap(m, len); errno = EIO; return MAP_FAILED;
        }
        return m;
    }
    /* not page aligned in its shard: a private copy */
    held_close(&h);
    void *m = real_mmap(addr, len, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | (flags & (MAP_FIXED | MAP_FIXED_NOREPLACE | MAP_POPULATE)),
                        -1, 0);
    if (m == MAP_FAILED) return m;
    if (vread(fd, &r, m, pos, cover) != V_OK) { munmap(m, len); errno = EIO; return MAP_FAILED; }
    if (!(prot & PROT_WRITE) && mprotect(m, len, prot) != 0) { munmap(m, len); return MAP_FAILED; }
    return m;
}
API void *mmap64(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
    return mmap(addr, len, prot, flags, fd, off);
}

/* ---- stat ------------------------------------------------------------------------------- */

static int do_fstatat(int dirfd, const char *path, struct stat *st, int flags) {
    INIT();
    if (path && !path[0] && (flags & AT_EMPTY_PATH)) {
        Row r;
        if (dirfd != AT_FDCWD && get_row(dirfd, &r)) { fill_stat(r.e, st); return 0; }
        if (dirfd == AT_FDCWD && vcwd[0]) path = ".";
        else return real_fstatat(dirfd, path, st, flags);
    }
    Res r;
    resolve(&r, dirfd, path, !(flags & AT_SYMLINK_NOFOLLOW));
    if (r.kind == R_REAL) {
        int rc = real_fstatat(dirfd, r.path, st, flags);
        if (rc == 0 || !via_link(&r, dirfd, !(flags & AT_SYMLINK_NOFOLLOW))) return rc;
    }
    if (r.kind == R_ERR) { errno = r.err; return -1; }
    fill_stat(r.e, st);
    return 0;
}

API int stat(const char *p, struct stat *st) { return do_fstatat(AT_FDCWD, p, st, 0); }
_Static_assert(sizeof(struct stat) == sizeof(struct stat64), "a 64-bit platform: stat is stat64");
API int stat64(const char *p, struct stat64 *st) { return do_fstatat(AT_FDCWD, p, (struct stat *)st, 0); }
API int lstat(const char *p, struct stat *st) { return do_fstatat(AT_FDCWD, p, st, AT_SYMLINK_NOFOLLOW); }
API int lstat64(const char *p, struct stat64 *st) { return do_fstatat(AT_FDCWD, p, (struct stat *)st, AT_SYMLINK_NOFOLLOW); }
API int fstatat(int d, const char *p, struct stat *st, int fl) { return do_fstatat(d, p, st, fl); }
API int fstatat64(int d, const char *p, struct stat64 *st, int fl) { return do_fstatat(d, p, (struct stat *)st, fl); }
API int fstat(int fd, struct stat *st) {
    INIT();
    Row r;
    if (get_row(fd, &r)) { fill_stat(r.e, st); return 0; }
    return real_fstat(fd, st);
}
API int fstat64(int fd, struct stat64 *st) { return fstat(fd, (struct stat *)st); }
/* the glibc < 2.33 entry points, for programs built against them */
API int __xstat(int v, const char *p, struct stat *st) { (void)v; return stat(p, st); }
API int __xstat64(int v, const char *p, struct stat *st) { (void)v; return stat(p, st); }
API int __lxstat(int v, const char *p, struct stat *st) { (void)v; return lstat(p, st); }
API int __lxstat64(int v, const char *p, struct stat *st) { (void)v; return lstat(p, st); }
API int __fxstat(int v, int fd, struct stat *st) { (void)v; return fstat(fd, st); }
API int __fxstat64(int v, int fd, struct stat *st) { (void)v; return fstat(fd, st); }
API int __fxstatat(int v, int d, const char *p, struct stat *st, int fl) { (void)v; return do_fstatat(d, p, st, fl); }
API int __fxstatat64(int v, int d, const char *p, struct stat *st, int fl) { (void)v; return do_fstatat(d, p, st, fl); }

API int statx(int dirfd, const char *path, int flags, unsigned mask, struct statx *sx) {
    INIT();
    if (path && !path[0] && (flags & AT_EMPTY_PATH)) {
        Row r;
        if (dirfd != AT_FDCWD && get_row(dirfd, &r)) { fill_statx(r.e, sx); return 0; }
        if (!(dirfd == AT_FDCWD && vcwd[0])) return real_statx(dirfd, path, flags, mask, sx);
        path = ".";
    }
    Res r;
    resolve(&r, dirfd, path, !(flags & AT_SYMLINK_NOFOLLOW));
    if (r.kind == R_REAL) {
        int rc = real_statx(dirfd, r.path, flags, mask, sx);
        if (rc == 0 || !via_link(&r, dirfd, !(flags & AT_SYMLINK_NOFOLLOW))) return rc;
    }
    if (r.kind == R_ERR) { errno = r.err; return -1; }
    fill_statx(r.e, sx);
    return 0;
}

static int do_access(int dirfd, const char *path, int mode, int flags) {
    INIT();
    Res r;
    resolve(&r, dirfd, path, !(flags & AT_SYMLINK_NOFOLLOW));
    if (r.kind == R_REAL) {
        int rc = real_faccessat(dirfd, r.path, mode, flags);
        if (rc == 0 || !via_link(&r, dirfd, !(flags & AT_SYMLINK_NOFOLLOW))) return rc;
    }
    if (r.kind == R_ERR) { errno = r.err; return -1; }
    if (mode & W_OK) { errno = EROFS; return -1; }
    if ((mode & X_OK) && !(D.mode[r.e] & 0111)) { errno = EACCES; return -1; }
    return 0;
}
API int access(const char *p, int mode) { return do_access(AT_FDCWD, p, mode, 0); }
API int euidaccess(const char *p, int mode) { return do_access(AT_FDCWD, p, mode, AT_EACCESS); }
API int eaccess(const char *p, int mode) { return do_access(AT_FDCWD, p, mode, AT_EACCESS); }
API int faccessat(int d, const char *p, int mode, int fl) { return do_access(d, p, mode, fl); }

/* ---- symlinks and real paths ------------------------------------------------------------ */

API ssize_t readlinkat(int dirfd, const char *path, char *buf, size_t size) {
    INIT();
    Res r;
    const char *rest;
    Row row;
    int fd = D.active && path && path[0] == '/' && strncmp(path, "/dev/std", 8) ? fd_path(path, &rest) : -1;
    if (fd >= 0 && !*rest && get_row(fd, &row)) {  /* /proc/self/fd/N: the file's own path */
        char tmp[PATH_MAX];
        if (entry_path(row.e, tmp, sizeof tmp) != 0) { errno = ENAMETOOLONG; return -1; }
        size_t n = strlen(tmp) < size ? strlen(tmp) : size;
        memcpy(buf, tmp, n);
        return (ssize_t)n;
    }
    resolve(&r, dirfd, path, 0);
    if (r.kind == R_REAL) {
        ssize_t n = real_readlinkat(dirfd, r.path, buf, size);
        if (n >= 0 || !via_link(&r, dirfd, 0)) return n;
    }
    if (r.kind == R_ERR) { errno = r.err; return -1; }
    if (D.kind[r.e] != K_LINK) { errno = EINVAL; return -1; }
    uint64_t off = D.offset[r.e], len = D.stored[r.e];
    if (off > D.nstrings || len > D.nstrings - off) { errno = EIO; return -1; }
    size_t n = len < size ? (size_t)len : size;
    memcpy(buf, D.strings + off, n);
    return (ssize_t)n;
}
API ssize_t readlink(const char *p, char *buf, size_t size) { return readlinkat(AT_FDCWD, p, buf, size); }
API ssize_t __readlink_chk(const char *p, char *buf, size_t size, size_t buflen) { (void)buflen; return readlinkat(AT_FDCWD, p, buf, size); }
API ssize_t __readlinkat_chk(int d, const char *p, char *buf, size_t size, size_t buflen) { (void)buflen; return readlinkat(d, p, buf, size); }

API char *realpath(const char *path, char *out) {
    INIT();
    Res r;
    if (!path) { errno = EINVAL; return NULL; }
    resolve(&r, AT_FDCWD, path, 1);
    if (r.kind == R_REAL) {
        char *got = real_realpath(r.path, out);
        if (got || !via_link(&r, AT_FDCWD, 1)) return got;
    }
    if (r.kind == R_ERR) { errno = r.err; return NULL; }
    char tmp[PATH_MAX];
    if (entry_path(r.e, tmp, sizeof tmp) != 0) { errno = ENAMETOOLONG; return NULL; }
    if (!out) return strdup(tmp);
    strcpy(out, tmp);
    return out;
}
API char *__realpath_chk(const char *p, char *out, size_t outlen) { (void)outlen; return realpath(p, out); }
API char *canonicalize_file_name(const char *p) { return realpath(p, NULL); }

/* ---- the current directory -------------------------------------------------------------- */

API char *getcwd(char *buf, size_t size) {
    INIT();
    if (!D.active) return real_getcwd(buf, size);
    pthread_mutex_lock(&cwd_lock);
    if (!vcwd[0]) { pthread_mutex_unlock(&cwd_lock); return real_getcwd(buf, size); }
    size_t n = strlen(vcwd) + 1;
    char *out = buf;
    if (!buf) out = malloc(size > n ? size : n);
    else if (size < n) { pthread_mutex_unlock(&cwd_lock); errno = size ? ERANGE : EINVAL; return NULL; }
    if (out) memcpy(out, vcwd, n);
    pthread_mutex_unlock(&cwd_lock);
    return out;
}
API char *__getcwd_chk(char *buf, size_t size, size_t buflen) { (void)buflen; return getcwd(buf, size); }
API char *get_current_dir_name(void) { return getcwd(NULL, 0); }

/* Into staged directory e: remember it, and make the real current directory the run's empty
 * directory (relative paths that a call outside these wrappers resolves find nothing). */
static int enter(uint32_t e) {
    if (D.kind[e] != K_DIR) { errno = ENOTDIR; return -1; }
    char p[PATH_MAX];
    if (entry_path(e, p, sizeof p) != 0) { errno = ENAMETOOLONG; return -1; }
    if (real_chdir(D.empty_dir) != 0) return -1;
    if (borrowed()) { strcpy(kid.vcwd, p); kid.cwd_set = 1; return 0; }
    pthread_mutex_lock(&cwd_lock);
    strcpy(vcwd, p);
    pthread_mutex_unlock(&cwd_lock);
    return 0;
}

/* The real current directory changed (or the process starts outside the tree). */
static void leave(void) {
    char here[PATH_MAX];
    int above = real_getcwd(here, sizeof here) != NULL;
    size_t n = above ? strlen(here) : 0, m = n == 1 ? 0 : n;  /* "/": every root is below */
    above = above && D.root_len > m && memcmp(D.root, here, m) == 0 && D.root[m] == '/';
    if (owner && borrowed()) { kid.vcwd[0] = 0; kid.cwd_set = 1; return; }
    pthread_mutex_lock(&cwd_lock);
    vcwd[0] = 0;
    if (above) memcpy(rcwd, here, n + 1);
    else rcwd[0] = 0;
    pthread_mutex_unlock(&cwd_lock);
}

API int chdir(const char *path) {
    INIT();
    Res r;
    resolve(&r, AT_FDCWD, path, 1);
    if (r.kind == R_ERR) { errno = r.err; return -1; }
    if (r.kind == R_STAGED) return enter(r.e);
    int rc = real_chdir(r.path);
    if (rc != 0 && via_link(&r, AT_FDCWD, 1)) {
        if (r.kind == R_ERR) { errno = r.err; return -1; }
        return enter(r.e);
    }
    if (rc == 0 && D.active) leave();
    return rc;
}

API int fchdir(int fd) {
    INIT();
    Row r;
    if (get_row(fd, &r)) { if (r.kind != F_DIRFD) { errno = ENOTDIR; return -1; } return enter(r.e); }
    int rc = real_fchdir(fd);
    if (rc == 0 && D.active) leave();
    return rc;
}

/* ---- directories ------------------------------------------------------------------------ */

enum { SDIR_MAGIC = 0x53444952 };
typedef struct {
    uint32_t e;
    int fd;
    uint64_t pos;  /* 0 ".", 1 "..", 2 + k: child k */
    struct dirent64 ent;
} SDir;

static SDir **sdirs;
static size_t nsdirs, capsdirs;

static int is_sdir(DIR *d) {
    if (!D.active || !d) return 0;
    pthread_mutex_lock(&lock);
    int found = 0;
    for (size_t i = 0; i < nsdirs; i++) if ((DIR *)sdirs[i] == d) { found = 1; break; }
    pthread_mutex_unlock(&lock);
    return found;
}

static DIR *new_sdir(int fd, uint32_t e) {
    SDir *s = calloc(1, sizeof *s);
    if (!s) { errno = ENOMEM; return NULL; }
    s->fd = fd; s->e = e;
    pthread_mutex_lock(&lock);
    if (nsdirs == capsdirs) {
        size_t cap = capsdirs ? capsdirs * 2 : 16;
        SDir **n = realloc(sdirs, cap * sizeof *n);
        if (!n) { pthread_mutex_unlock(&lock); free(s); errno = ENOMEM; return NULL; }
        sdirs = n; capsdirs = cap;
    }
    sdirs[nsdirs++] = s;
    pthread_mutex_unlock(&lock);
    return (DIR *)s;
}

/* The directory entry at position pos of directory e (0: ".", 1: ".."); 0 at the end. */
static int dir_item(uint32_t e, uint64_t pos, uint64_t *ino, uint8_t *type, const char **name, size_t *nl) {
    if (pos == 0) { *ino = e + 1; *type = DT_DIR; *name = "."; *nl = 1; return 1; }
    if (pos == 1) { *ino = (e ? D.parent[e] : e) + 1; *type = DT_DIR; *name = ".."; *nl = 2; return 1; }
    uint64_t k = pos - 2;
    if (D.first[e] == NONE || k >= D.count[e] || D.first[e] + k >= D.n) return 0;
    uint32_t c = D.first[e] + (uint32_t)k;
    *ino = c + 1;
    *type = D.kind[c] == K_DIR ? DT_DIR : D.kind[c] == K_LINK ? DT_LNK : DT_REG;
    *name = name_of(c, nl);
    return 1;
}

API DIR *opendir(const char *path) {
    INIT();
    Res r;
    resolve(&r, AT_FDCWD, path, 1);
    if (r.kind == R_REAL) {
        DIR *d = real_opendir(r.path);
        if (d || !via_link(&r, AT_FDCWD, 1)) return d;
    }
    if (r.kind == R_ERR) { errno = r.err; return NULL; }
    if (D.kind[r.e] != K_DIR) { errno = ENOTDIR; return NULL; }
    int fd = open_entry(r.e, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return NULL;
    DIR *d = new_sdir(fd, r.e);
    if (!d) close(fd);
    return d;
}

API DIR *fdopendir(int fd) {
    INIT();
    Row r;
    if (!get_row(fd, &r)) return real_fdopendir(fd);
    if (r.kind != F_DIRFD || D.kind[r.e] != K_DIR) { errno = ENOTDIR; return NULL; }
    return new_sdir(fd, r.e);
}

static struct dirent64 *sdir_next(SDir *s) {
    uint64_t ino; uint8_t type; const char *name; size_t nl;
    if (!dir_item(s->e, s->pos, &ino, &type, &name, &nl)) return NULL;
    if (nl > 255) nl = 255;
    s->ent.d_ino = ino;
    s->ent.d_off = (off_t)(s->pos + 1);
    s->ent.d_reclen = sizeof s->ent;
    s->ent.d_type = type;
    memcpy(s->ent.d_name, name, nl);
    s->ent.d_name[nl] = 0;
    s->pos++;
    return &s->ent;
}

API struct dirent *readdir(DIR *d) {
    INIT();
    if (!is_sdir(d)) return real_readdir(d);
    return (struct dirent *)sdir_next((SDir *)d);
}
API struct dirent64 *readdir64(DIR *d) {
    INIT();
    if (!is_sdir(d)) return real_readdir64(d);
    return sdir_next((SDir *)d);
}
API int readdir_r(DIR *d, struct dirent *ent, struct dirent **res) {
    INIT();
    struct dirent *got;
    if (!is_sdir(d)) { errno = 0; got = real_readdir(d); if (!got && errno) return errno; }
    else got = (struct dirent *)sdir_next((SDir *)d);
    if (got) { memcpy(ent, got, sizeof *ent); *res = ent; } else *res = NULL;
    return 0;
}
API int readdir64_r(DIR *d, struct dirent64 *ent, struct dirent64 **res) {
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    return readdir_r(d, (struct dirent *)ent, (struct dirent **)res);
}

API int closedir(DIR *d) {
    INIT();
    if (!is_sdir(d)) return real_closedir(d);
    SDir *s = (SDir *)d;
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < nsdirs; i++) if (sdirs[i] == s) { sdirs[i] = sdirs[--nsdirs]; break; }
    pthread_mutex_unlock(&lock);
    int rc = close(s->fd);
    free(s);
    return rc;
}
API int dirfd(DIR *d) { INIT(); return is_sdir(d) ? ((SDir *)d)->fd : real_dirfd(d); }
API void rewinddir(DIR *d) { INIT(); if (is_sdir(d)) ((SDir *)d)->pos = 0; else real_rewinddir(d); }
API long telldir(DIR *d) { INIT(); return is_sdir(d) ? (long)((SDir *)d)->pos : real_telldir(d); }
API void seekdir(DIR *d, long pos) { INIT(); if (is_sdir(d)) ((SDir *)d)->pos = (uint64_t)pos; else real_seekdir(d, pos); }

API ssize_t getdents64(int fd, void *buf, size_t n) {
    INIT();
    Row r;
    if (!get_row(fd, &r)) return real_getdents64(fd, buf, n);
    if (r.kind == F_DIRFD && D.kind[r.e] != K_DIR) return real_getdents64(fd, buf, n);  /* O_PATH */
    if (r.kind != F_DIRFD) { errno = ENOTDIR; return -1; }
    size_t used = 0;
    uint64_t pos = r.dpos, ino; uint8_t type; const char *name; size_t nl;
    while (dir_item(r.e, pos, &ino, &type, &name, &nl)) {
        size_t rec = (offsetof(struct dirent64, d_name) + nl + 1 + 7) & ~(size_t)7;
        if (used + rec > n) { if (!used) { errno = EINVAL; return -1; } break; }
        struct dirent64 *d = (struct dirent64 *)((char *)buf + used);
        d->d_ino = ino; d->d_off = (off_t)(pos + 1); d->d_reclen = (unsigned short)rec; d->d_type = type;
        memcpy(d->d_name, name, nl);
        memset(d->d_name + nl, 0, rec - offsetof(struct dirent64, d_name) - nl);
        used += rec;
        pos++;
    }
    row_begin(fd);
    if (rows[fd].kind == F_DIRFD && rows[fd].ino == r.ino)
        __atomic_store_n(&rows[fd].dpos, pos, __ATOMIC_RELAXED);
    row_end(fd);
    return (ssize_t)used;
}

/* ---- stdio ------------------------------------------------------------------------------ */

static ssize_t ck_read(void *c, char *buf, size_t n) { return read((int)(intptr_t)c, buf, n); }
static int ck_seek(void *c, off64_t *pos, int whence) {
    off_t got = lseek((int)(intptr_t)c, (off_t)*pos, whence);
    if (got < 0) return -1;
    *pos = got;
    return 0;
}
static int ck_close(void *c) { return close((int)(intptr_t)c); }

/* A FILE reading staged descriptor fd through the wrappers (glibc's stdio reads with its
 * internal read, which no preload sees); fileno() still gives fd. */
static FILE *cookie_file(int fd, const char *mode) {
    cookie_io_functions_t io = {.read = ck_read, .write = NULL, .seek = ck_seek, .close = ck_close};
    FILE *f = fopencookie((void *)(intptr_t)fd, mode, io);
    if (!f) return NULL;
    f->_fileno = fd;
    return f;
}

static int wants_write(const char *mode) { return strpbrk(mode, "wa+") != NULL; }

static FILE *do_fopen(const char *path, const char *mode) {
    INIT();
    Res r;
    resolve(&r, AT_FDCWD, path, 1);
    if (r.kind == R_REAL) {
        FILE *f = real_fopen(r.path, mode);
        if (f || !via_link(&r, AT_FDCWD, 1)) return f;
    }
    if (wants_write(mode)) { errno = EROFS; return NULL; }
    if (r.kind == R_ERR) { errno = r.err; return NULL; }
    int fd = open_entry(r.e, strchr(mode, 'e') ? O_RDONLY | O_CLOEXEC : O_RDONLY);
    if (fd < 0) return NULL;
    Row row;
    get_row(fd, &row);
    FILE *f = row.kind == F_SHARD ? cookie_file(fd, "r") : real_fdopen(fd, "r");
    if (!f) { int err = errno; close(fd); errno = err; }
    return f;
}
API FILE *fopen(const char *p, const char *m) { return do_fopen(p, m); }
API FILE *fopen64(const char *p, const char *m) { return do_fopen(p, m); }

API FILE *fdopen(int fd, const char *mode) {
    INIT();
    Row r;
    if (get_row(fd, &r) && r.kind == F_SHARD) return cookie_file(fd, mode);
    return real_fdopen(fd, mode);
}

/* freopen of a staged path: the stream keeps its FILE, so it gets a descriptor the kernel
 * serves (the helper's verified copy), reopened through /proc/self/fd. */
static FILE *do_freopen(const char *path, const char *mode, FILE *f) {
    INIT();
    Res r;
    resolve(&r, AT_FDCWD, path, 1);
    if (!path || r.kind == R_REAL) return real_freopen(path ? r.path : NULL, mode, f);
    if (wants_write(mode)) { errno = EROFS; return NULL; }
    if (r.kind == R_ERR) { errno = r.err; return NULL; }
    if (D.kind[r.e] != K_FILE) { errno = EISDIR; return NULL; }
    int m = helper_file(r.e, 1);
    if (m < 0) return NULL;
    char p[64];
    snprintf(p, sizeof p, "/proc/self/fd/%d", m);
    FILE *got = real_freopen(p, mode, f);
    real_close(m);
    if (got) make_row(fileno(got), F_MEM, r.e, 0, 0);
    return got;
}
API FILE *freopen(const char *p, const char *m, FILE *f) { return do_freopen(p, m, f); }
API FILE *freopen64(const char *p, const char *m, FILE *f) { return do_freopen(p, m, f); }

/* ---- extended attributes: a file system without them ------------------------------------ */

/* -2: a real path, in r->path (made plain: "/root/.." is the root's parent, which the
 * kernel, to whom the root does not exist, would not find) */
static ssize_t no_xattr(Res *r, const char *path, int follow, int list) {
    resolve(r, AT_FDCWD, path, follow);
    if (r->kind == R_REAL) return -2;
    if (r->kind == R_ERR) { errno = r->err; return -1; }
    if (list) return 0;
    errno = ENOTSUP;
    return -1;
}
/* The real call's answer, unless it did not find a path that a real symlink leads into the
 * tree (via_link): then the tree's. */
static ssize_t real_xattr(Res *r, ssize_t rc, int follow, int list) {
    if (rc >= 0 || !via_link(r, AT_FDCWD, follow)) return rc;
    if (r->kind == R_ERR) { errno = r->err; return -1; }
    if (list) return 0;
    errno = ENOTSUP;
    return -1;
}
API ssize_t getxattr(const char *p, const char *n, void *v, size_t s) {
    INIT(); Res r; ssize_t rc = no_xattr(&r, p, 1, 0); return rc == -2 ? real_xattr(&r, real_getxattr(r.path, n, v, s), 1, 0) : rc;
}
API ssize_t lgetxattr(const char *p, const char *n, void *v, size_t s) {
    INIT(); Res r; ssize_t rc = no_xattr(&r, p, 0, 0); return rc == -2 ? real_xattr(&r, real_lgetxattr(r.path, n, v, s), 0, 0) : rc;
}
API ssize_t listxattr(const char *p, char *l, size_t s) {
    INIT(); Res r; ssize_t rc = no_xattr(&r, p, 1, 1); return rc == -2 ? real_xattr(&r, real_listxattr(r.path, l, s), 1, 1) : rc;
}
API ssize_t llistxattr(const char *p, char *l, size_t s) {
    INIT(); Res r; ssize_t rc = no_xattr(&r, p, 0, 1); return rc == -2 ? real_xattr(&r, real_llistxattr(r.path, l, s), 0, 1) : rc;
}
API ssize_t fgetxattr(int fd, const char *n, void *v, size_t s) {
    INIT(); Row r; if (get_row(fd, &r)) { errno = ENOTSUP; return -1; } return real_fgetxattr(fd, n, v, s);
}
API ssize_t flistxattr(int fd, char *l, size_t s) {
    INIT(); Row r; if (get_row(fd, &r)) return 0; return real_flistxattr(fd, l, s);
}

/* ---- writes under the root: EROFS, nothing done ----------------------------------------- */

/* Where a write call's path lies. 0: outside the tree, and r->path is the path to hand the
 * real call: as given, or made plain when it entered the tree and left it through ".."
 * ("AT/../x" is AT's parent's x: the kernel, to whom AT may not exist, would not find it).
 * 1: in the tree (an entry, or an error there): the call is refused with EROFS. */
static int staged(Res *r, int dirfd, const char *path, int follow) {
    resolve(r, dirfd, path, follow);
    return r->kind != R_REAL;
}
#define REFUSE1(dirfd, path, follow) \
    Res r_; do { INIT(); if (staged(&r_, dirfd, path, follow)) { errno = EROFS; return -1; } } while (0)
#define REFUSE2(od, op, nd, np) \
    Res ro_, rn_; do { INIT(); if (staged(&ro_, od, op, 0) || staged(&rn_, nd, np, 0)) { errno = EROFS; return -1; } } while (0)

API int unlinkat(int d, const char *p, int fl) { REFUSE1(d, p, 0); return real_unlinkat(d, r_.path, fl); }
API int unlink(const char *p) { return unlinkat(AT_FDCWD, p, 0); }
API int rmdir(const char *p) { return unlinkat(AT_FDCWD, p, AT_REMOVEDIR); }
API int remove(const char *p) {
    REFUSE1(AT_FDCWD, p, 0);
    struct stat st;
    if (real_fstatat(AT_FDCWD, r_.path, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode))
        return real_unlinkat(AT_FDCWD, r_.path, AT_REMOVEDIR);
    return real_unlinkat(AT_FDCWD, r_.path, 0);
}
API int renameat2(int od, const char *op, int nd, const char *np, unsigned fl) {
    REFUSE2(od, op, nd, np);
    return real_renameat2(od, ro_.path, nd, rn_.path, fl);
}
API int renameat(int od, const char *op, int nd, const char *np) { return renameat2(od, op, nd, np, 0); }
API int rename(const char *op, const char *np) { return renameat2(AT_FDCWD, op, AT_FDCWD, np, 0); }
API int mkdirat(int d, const char *p, mode_t m) { REFUSE1(d, p, 0); return real_mkdirat(d, r_.path, m); }
API int mkdir(const char *p, mode_t m) { return mkdirat(AT_FDCWD, p, m); }
API int fchmodat(int d, const char *p, mode_t m, int fl) { REFUSE1(d, p, !(fl & AT_SYMLINK_NOFOLLOW)); return real_fchmodat(d, r_.path, m, fl); }
API int chmod(const char *p, mode_t m) { return fchmodat(AT_FDCWD, p, m, 0); }
API int lchmod(const char *p, mode_t m) { return fchmodat(AT_FDCWD, p, m, AT_SYMLINK_NOFOLLOW); }
API int fchownat(int d, const char *p, uid_t u, gid_t g, int fl) { REFUSE1(d, p, !(fl & AT_SYMLINK_NOFOLLOW)); return real_fchownat(d, r_.path, u, g, fl); }
API int chown(const char *p, uid_t u, gid_t g) { return fchownat(AT_FDCWD, p, u, g, 0); }
API int lchown(const char *p, uid_t u, gid_t g) { return fchownat(AT_FDCWD, p, u, g, AT_SYMLINK_NOFOLLOW); }
API int truncate(const char *p, off_t len) { REFUSE1(AT_FDCWD, p, 1); return real_truncate(r_.path, len); }
API int truncate64(const char *p, off_t len) { return truncate(p, len); }
API int linkat(int od, const char *op, int nd, const char *np, int fl) {
    REFUSE2(od, op, nd, np);
    return real_linkat(od, ro_.path, nd, rn_.path, fl);
}
API int link(const char *op, const char *np) { return linkat(AT_FDCWD, op, AT_FDCWD, np, 0); }
API int symlinkat(const char *target, int d, const char *p) { REFUSE1(d, p, 0); return real_symlinkat(target, d, r_.path); }
API int symlink(const char *target, const char *p) { return symlinkat(target, AT_FDCWD, p); }
/* A call that changes the file behind a descriptor: on a staged one it would change the
 * tier's or the origin's shard (or the run's empty directory), which a read-only
 * descriptor does not prevent. */
#define REFUSE_FD(fd) do { INIT(); Row w_; if (get_row(fd, &w_)) { errno = EROFS; return -1; } } while (0)
API int fchmod(int fd, mode_t m) { REFUSE_FD(fd); return real_fchmod(fd, m); }
API int fchown(int fd, uid_t u, gid_t g) { REFUSE_FD(fd); return real_fchown(fd, u, g); }
API int futimens(int fd, const struct timespec t[2]) { REFUSE_FD(fd); return real_futimens(fd, t); }
API int futimes(int fd, const struct timeval t[2]) { REFUSE_FD(fd); return real_futimes(fd, t); }
API int fsetxattr(int fd, const char *n, const void *v, size_t s, int fl) { REFUSE_FD(fd); return real_fsetxattr(fd, n, v, s, fl); }
API int fremovexattr(int fd, const char *n) { REFUSE_FD(fd); return real_fremovexattr(fd, n); }
API int utimensat(int d, const char *p, const struct timespec t[2], int fl) {
    INIT();
    Res r;
    if (p == NULL) { REFUSE_FD(d); return real_utimensat(d, p, t, fl); }
    if (staged(&r, d, p, !(fl & AT_SYMLINK_NOFOLLOW))) { errno = EROFS; return -1; }
    return real_utimensat(d, r.path, t, fl);
}
API int mknodat(int d, const char *p, mode_t m, dev_t dev) { REFUSE1(d, p, 0); return real_mknodat(d, r_.path, m, dev); }
API int mknod(const char *p, mode_t m, dev_t dev) { return mknodat(AT_FDCWD, p, m, dev); }
API int mkfifo(const char *p, mode_t m) { return mknodat(AT_FDCWD, p, m | S_IFIFO, 0); }
API int setxattr(const char *p, const char *n, const void *v, size_t s, int fl) { REFUSE1(AT_FDCWD, p, 1); return real_setxattr(r_.path, n, v, s, fl); }
API int lsetxattr(const char *p, const char *n, const void *v, size_t s, int fl) { REFUSE1(AT_FDCWD, p, 0); return real_lsetxattr(r_.path, n, v, s, fl); }
API int removexattr(const char *p, const char *n) { REFUSE1(AT_FDCWD, p, 1); return real_removexattr(r_.path, n); }
API int lremovexattr(const char *p, const char *n) { REFUSE1(AT_FDCWD, p, 0); return real_lremovexattr(r_.path, n); }

/* ---- exec: the child inherits the staged descriptors and directory ---------------------- */

/* envp with LD_PRELOAD holding this library, STAGEFS_PRELOAD_INDEX, and this process's
 * inheritable staged descriptors and staged current directory. NULL: use envp as it is. */
static char **child_env(char *const envp[]) {
    if (!D.active) return NULL;
    size_t n = 0;
    while (envp && envp[n]) n++;
    char **out = calloc(n + 8, sizeof(char *));
    if (!out) return NULL;
    size_t k = 0;
    const char *preload = NULL;
    for (size_t i = 0; i < n; i++) {
        if (!strncmp(envp[i], "STAGEFS_PRELOAD_FDS=", 20) || !strncmp(envp[i], "STAGEFS_PRELOAD_CWD=", 20) ||
            !strncmp(envp[i], "STAGEFS_PRELOAD_INDEX=", 22))
            continue;
        if (!strncmp(envp[i], "LD_PRELOAD=", 11)) { preload = envp[i]; continue; }
        out[k++] = envp[i];
    }
    /* LD_PRELOAD, with this library first */
    const char *self = D.self_path ? D.self_path : "";
    const char *rest = preload ? preload + 11 : "";
    char *pl;
    if (strstr(rest, self) && *self) pl = strdup(preload);
    else if (asprintf(&pl, "LD_PRELOAD=%s%s%s", self, *rest ? " " : "", rest) < 0) pl = NULL;
    if (pl) out[k++] = pl;
    char *ix;
    if (asprintf(&ix, "STAGEFS_PRELOAD_INDEX=%s", D.sidecar_path) >= 0) out[k++] = ix;
    /* the staged descriptors the child keeps (no close-on-exec) */
    size_t cap = 64, used = 0;
    char *fds = malloc(cap);
    if (fds) {
        used = (size_t)sprintf(fds, "STAGEFS_PRELOAD_FDS=");
        /* the table's rows, then a vfork child's own where the table has none */
        int extra = borrowed() ? kid.n : 0;
        for (int i = 0; i < max_fd + extra; i++) {
            int fd = i < max_fd ? i : kid.fd[i - max_fd];
            if ((i < max_fd) != (__atomic_load_n(&rows[fd].kind, __ATOMIC_ACQUIRE) != 0)) continue;
            Row r;
            if (!get_row(fd, &r)) continue;
            int fl = real_fcntl(fd, F_GETFD);
            if (fl < 0 || (fl & FD_CLOEXEC)) continue;
            char item[160];
            int il = snprintf(item, sizeof item, "%d,%u,%u,%llu,%u,%llu,%llu;", fd, r.kind, r.e,
                              (unsigned long long)r.base, r.src, (unsigned long long)r.dev,
                              (unsigned long long)r.ino);
            if (used + (size_t)il + 1 > cap) {
                char *g = realloc(fds, cap * 2 + (size_t)il);
                if (!g) break;
                fds = g; cap = cap * 2 + (size_t)il;
            }
            memcpy(fds + used, item, (size_t)il + 1);
            used += (size_t)il;
        }
        out[k++] = fds;
    }
    const char *cwd = borrowed() && kid.cwd_set ? kid.vcwd : vcwd;
    if (cwd[0]) {
        char *c;
        if (asprintf(&c, "STAGEFS_PRELOAD_CWD=%s", cwd) >= 0) out[k++] = c;
    }
    out[k] = NULL;
    return out;
}

static void free_env(char **env, char *const envp[]) {
    if (!env) return;
    for (size_t i = 0; env[i]; i++) {
        int theirs = 0;
        for (size_t j = 0; envp && envp[j]; j++) if (env[i] == envp[j]) { theirs = 1; break; }
        if (!theirs) free(env[i]);
    }
    free(env);
}

API int execve(const char *path, char *const argv[], char *const envp[]) {
    INIT();
    Res r;
    resolve(&r, AT_FDCWD, path, 1);
    if (r.kind == R_ERR) { errno = r.err; return -1; }
    char **env = child_env(envp);
    int rc;
    if (r.kind == R_STAGED) {  /* a program in the tree: run the helper's verified copy */
        int m = D.kind[r.e] == K_FILE ? helper_file(r.e, 0) : -1;
        if (m < 0) { if (D.kind[r.e] != K_FILE) errno = EACCES; rc = -1; }
        else { rc = real_execveat(m, "", argv, env ? env : envp, AT_EMPTY_PATH); real_close(m); }
    } else {
        rc = real_execve(r.path, argv, env ? env : envp);
    }
    int err = errno;
    free_env(env, envp);
    errno = err;
    return rc;
}
API int execveat(int d, const char *path, char *const argv[], char *const envp[], int fl) {
    INIT();
    char **env = child_env(envp);
    int rc = real_execveat(d, path, argv, env ? env : envp, fl);
    int err = errno;
    free_env(env, envp);
    errno = err;
    return rc;
}
API int fexecve(int fd, char *const argv[], char *const envp[]) {
    return execveat(fd, "", argv, envp, AT_EMPTY_PATH);
}
API int execvpe(const char *file, char *const argv[], char *const envp[]) {
    INIT();
    char **env = child_env(envp);
    int rc = real_execvpe(file, argv, env ? env : envp);
    int err = errno;
    free_env(env, envp);
    errno = err;
    return rc;
}
API int execv(const char *path, char *const argv[]) { return execve(path, argv, environ); }
API int execvp(const char *file, char *const argv[]) { return execvpe(file, argv, environ); }

static char **va_argv(const char *a0, va_list ap, char ***envp) {
    size_t cap = 16, n = 0;
    char **v = malloc(cap * sizeof(char *));
    if (!v) return NULL;
    v[n++] = (char *)a0;
    for (;;) {
        char *a = a0 ? va_arg(ap, char *) : NULL;
        if (n + 1 >= cap) { char **g = realloc(v, (cap *= 2) * sizeof(char *)); if (!g) { free(v); return NULL; } v = g; }
        v[n++] = a;
        if (!a) break;
    }
    if (envp) *envp = va_arg(ap, char **);
    return v;
}
API int execl(const char *path, const char *a0, ...) {
    va_list ap; va_start(ap, a0); char **v = va_argv(a0, ap, NULL); va_end(ap);
    if (!v) { errno = ENOMEM; return -1; }
    int rc = execve(path, v, environ); int err = errno; free(v); errno = err; return rc;
}
API int execlp(const char *file, const char *a0, ...) {
    va_list ap; va_start(ap, a0); char **v = va_argv(a0, ap, NULL); va_end(ap);
    if (!v) { errno = ENOMEM; return -1; }
    int rc = execvpe(file, v, environ); int err = errno; free(v); errno = err; return rc;
}
API int execle(const char *path, const char *a0, ...) {
    char **envp = NULL;
    va_list ap; va_start(ap, a0); char **v = va_argv(a0, ap, &envp); va_end(ap);
    if (!v) { errno = ENOMEM; return -1; }
    int rc = execve(path, v, envp); int err = errno; free(v); errno = err; return rc;
}
API int posix_spawn(pid_t *pid, const char *path, const posix_spawn_file_actions_t *fa,
                    const posix_spawnattr_t *at, char *const argv[], char *const envp[]) {
    INIT();
    char **env = child_env(envp);
    int rc = real_posix_spawn(pid, path, fa, at, argv, env ? env : envp);
    free_env(env, envp);
    return rc;
}
API int posix_spawnp(pid_t *pid, const char *file, const posix_spawn_file_actions_t *fa,
                     const posix_spawnattr_t *at, char *const argv[], char *const envp[]) {
    INIT();
    char **env = child_env(envp);
    int rc = real_posix_spawnp(pid, file, fa, at, argv, env ? env : envp);
    free_env(env, envp);
    return rc;
}

/* system() and popen() start their child with environ: put this process's staged descriptors
 * and directory there first (under a lock; a thread reading the environment meanwhile sees
 * one value or the other). */
static pthread_mutex_t env_lock = PTHREAD_MUTEX_INITIALIZER;
static void sync_environ(void) {
    if (!D.active) return;
    char **env = child_env(environ);
    if (!env) return;
    unsetenv("STAGEFS_PRELOAD_CWD");
    for (size_t i = 0; env[i]; i++) {
        if (strncmp(env[i], "STAGEFS_PRELOAD_", 16) && strncmp(env[i], "LD_PRELOAD=", 11)) continue;
        char *eq = strchr(env[i], '=');
        *eq = 0;
        setenv(env[i], eq + 1, 1);
        *eq = '=';
    }
    free_env(env, environ);
}
REAL(int, system, const char *);
REAL(FILE *, popen, const char *, const char *);
API int system(const char *cmd) {
    INIT();
    if (!real_system) real_system = next_sym("system");
    pthread_mutex_lock(&env_lock);
    sync_environ();
    pthread_mutex_unlock(&env_lock);
    return real_system(cmd);
}
API FILE *popen(const char *cmd, const char *mode) {
    INIT();
    if (!real_popen) real_popen = next_sym("popen");
    pthread_mutex_lock(&env_lock);
    sync_environ();
    pthread_mutex_unlock(&env_lock);
    return real_popen(cmd, mode);
}

/* For a process that wants to know (the Python front end): 1 when the staged path is served. */
API int stagefs_preload_active(void) { INIT(); return D.active; }

/* For the Python front end (intercept.py): the descriptor of the staged file at path when
 * the caller has read its bytes already (through its Store, which verified and counted
 * them) and put them in m, a memfd it made (preload.py's memfd): m made read-only as the
 * helper's copies are (read_only), with the entry's row (fstat reports the manifest), so
 * that handing the program a descriptor reads and counts the file no second time, as an
 * open here would (the helper's Store, or a sample at the open of a tier's copy). m, or -1
 * with errno (m closed): EINVAL for a path not staged, EIO for bytes not the file's size. */
API int stagefs_preload_adopt(int m, const char *path) {
    INIT();
    Res r;
    struct stat st;
    int err = 0;
    if (!D.active || !path) err = EINVAL;
    else {
        resolve(&r, AT_FDCWD, path, 1);
        if (r.kind != R_STAGED) err = r.kind == R_ERR ? r.err : EINVAL;
        else if (D.kind[r.e] != K_FILE) err = EISDIR;
        else if (sys_fstat(m, &st) != 0) err = errno;
        else if ((uint64_t)st.st_size != D.size[r.e]) err = EIO;
    }
    if (err) { real_close(m); errno = err; return -1; }
    return make_row(read_only(m, 1), F_MEM, r.e, 0, 0);
}

/* The path a staged path names, for a Python caller: the entry index, or -1. */
API long stagefs_preload_entry(const char *path) {
    INIT();
    Res r;
    resolve(&r, AT_FDCWD, path, 1);
    return r.kind == R_STAGED ? (long)r.e : -1;
}
