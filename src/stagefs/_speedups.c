/* stagefs._speedups: the manifest's hot path (path -> entry -> os.stat_result) in C.
 *
 * Optional: stagefs works without it (namespace.py holds the same logic in Python and is
 * the reference). The C path handles only the common case — an already normalised path to
 * a regular file — and hands everything else (missing paths, directories, symlinks, paths
 * with "." or "//") to a Python fallback, so error handling lives in one place.
 *
 * It obeys the bounds the Python reader checks (format/validate.py): the arrays' lengths
 * agree at construction, a probe of the hash table stops after one pass over it, and an
 * entry index or a path's bytes outside the arrays end the lookup as "not found" (the
 * Python path then says what is wrong), never a read outside a buffer.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "_xxh3.h"

enum { KIND_FILE = 0 };

typedef struct {
    PyObject_HEAD
    Py_buffer slots, hashes, path_off, strings, kind, mode, size, mtime;
    int held;
    uint64_t mask;
    Py_ssize_t n;  /* entries */
    PyTypeObject *stat_type;
    PyObject *fallback_stat;
    long long dev, uid, gid, piece_size;
    PyObject *dev_o, *uid_o, *gid_o, *blksize_o, *piece_o;  /* the same in every result: made once */
} Index;

static void release(Index *self) {
    if (!self->held) return;
    PyBuffer_Release(&self->slots); PyBuffer_Release(&self->hashes);
    PyBuffer_Release(&self->path_off); PyBuffer_Release(&self->strings);
    PyBuffer_Release(&self->kind); PyBuffer_Release(&self->mode);
    PyBuffer_Release(&self->size); PyBuffer_Release(&self->mtime);
    self->held = 0;
}

static void Index_dealloc(Index *self) {
    release(self);
    Py_XDECREF(self->stat_type);
    Py_XDECREF(self->fallback_stat);
    Py_XDECREF(self->dev_o); Py_XDECREF(self->uid_o);
    Py_XDECREF(self->gid_o); Py_XDECREF(self->blksize_o); Py_XDECREF(self->piece_o);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int get(PyObject *arr, Py_buffer *view) {
    return PyObject_GetBuffer(arr, view, PyBUF_C_CONTIGUOUS);
}

static int Index_init(Index *self, PyObject *args, PyObject *kw) {
    PyObject *slots, *hashes, *path_off, *strings, *kind, *mode, *size, *mtime, *stat_type,
        *fallback;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOLLLL", &slots, &hashes, &path_off, &strings, &kind,
                          &mode, &size, &mtime, &stat_type, &fallback, &self->dev, &self->uid,
                          &self->gid, &self->piece_size))
        return -1;
    if (get(slots, &self->slots) || get(hashes, &self->hashes) ||
        get(path_off, &self->path_off) || get(strings, &self->strings) ||
        get(kind, &self->kind) || get(mode, &self->mode) || get(size, &self->size) ||
        get(mtime, &self->mtime))
        return -1;
    self->held = 1;
    Py_ssize_t nslots = self->slots.len / 4, n = self->hashes.len / 8;
    if (nslots == 0 || (nslots & (nslots - 1)) || nslots <= n) {
        PyErr_SetString(PyExc_ValueError, "slot table size is not a power of two above the "
                        "number of entries");
        return -1;
    }
    if (self->slots.len != nslots * 4 || self->hashes.len != n * 8 ||
        self->path_off.len != (n + 1) * 8 || self->kind.len != n || self->mode.len != n * 4 ||
        self->size.len != n * 8 || self->mtime.len != n * 8) {
        PyErr_SetString(PyExc_ValueError, "the manifest's arrays do not have one item per entry");
        return -1;
    }
    self->n = n;
    self->mask = (uint64_t)nslots - 1;
    Py_INCREF(stat_type); self->stat_type = (PyTypeObject *)stat_type;
    Py_INCREF(fallback); self->fallback_stat = fallback;
    self->dev_o = PyLong_FromLongLong(self->dev);
    self->uid_o = PyLong_FromLongLong(self->uid);
    self->gid_o = PyLong_FromLongLong(self->gid);
    self->blksize_o = PyLong_FromLong(65536);
    self->piece_o = PyLong_FromLongLong(self->piece_size);
    if (!self->dev_o || !self->uid_o || !self->gid_o || !self->blksize_o || !self->piece_o)
        return -1;
    return 0;
}

/* The entry of an exact key, or -1. At most one pass over the table, and no read outside
 * the arrays, whatever they hold. */
static Py_ssize_t find_key(Index *self, const char *key, Py_ssize_t len) {
    const uint32_t *slots = self->slots.buf;
    const uint64_t *hashes = self->hashes.buf, *off = self->path_off.buf;
    const char *strings = self->strings.buf;
    const uint64_t nstrings = (uint64_t)self->strings.len;
    uint64_t h = xxh3_64(key, (size_t)len);
    uint64_t i = h & self->mask;
    for (uint64_t probe = 0; probe <= self->mask; probe++) {
        uint32_t e = slots[i];
        if (e == 0 || (Py_ssize_t)e > self->n) return -1;
        e -= 1;
        if (hashes[e] == h && off[e] <= off[e + 1] && off[e + 1] <= nstrings &&
            off[e + 1] - off[e] == (uint64_t)len &&
            memcmp(strings + off[e], key, (size_t)len) == 0)
            return (Py_ssize_t)e;
        i = (i + 1) & self->mask;
    }
    return -1;
}

/* The key of a path that needs no normalisation, or NULL (not an error) if it does. */
static const char *plain_key(PyObject *path, Py_ssize_t *len) {
    const char *p;
    if (PyUnicode_CheckExact(path)) {
        p = PyUnicode_AsUTF8AndSize(path, len);
        if (p == NULL) { PyErr_Clear(); return NULL; }  /* surrogates: the Python path */
    } else if (PyBytes_CheckExact(path)) {
        p = PyBytes_AS_STRING(path); *len = PyBytes_GET_SIZE(path);
    } else {
        return NULL;
    }
    Py_ssize_t n = *len;
    if (n > 0 && p[0] == '/') { p++; n--; *len = n; }  /* "/a/b" is "a/b": the root's */
    if (n == 0 || p[0] == '/' || p[0] == '.' || p[n - 1] == '/') return NULL;
    for (Py_ssize_t k = 0; k + 1 < n; k++)
        if (p[k] == '/' && (p[k + 1] == '/' || p[k + 1] == '.')) return NULL;
    return p;
}

/* find(path) -> the entry of a regular file at a plain path, or -1 (use the Python path). */
static PyObject *Index_find(Index *self, PyObject *path) {
    Py_ssize_t len;
    const char *key = plain_key(path, &len);
    if (key == NULL || !self->held) return PyLong_FromLong(-1);
    Py_ssize_t e = find_key(self, key, len);
    if (e < 0 || ((const uint8_t *)self->kind.buf)[e] != KIND_FILE) return PyLong_FromLong(-1);
    return PyLong_FromSsize_t(e);
}

static PyObject *Index_lookup(Index *self, PyObject *key) {
    if (!PyBytes_Check(key)) { PyErr_SetString(PyExc_TypeError, "key must be bytes"); return NULL; }
    if (!self->held) { PyErr_SetString(PyExc_ValueError, "index released"); return NULL; }
    return PyLong_FromSsize_t(find_key(self, PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key)));
}

/* Put a new reference at item i of r; on failure drop r. */
#define SET(i, v) do { PyObject *o_ = (v); if (!o_) { Py_DECREF(r); return NULL; } \
                       PyStructSequence_SetItem(r, (i), o_); } while (0)
/* Put a shared object at items i, j, k (one new reference is consumed, two are added). */
#define SET3(i, j, k, v) do { PyObject *o_ = (v); if (!o_) { Py_DECREF(r); return NULL; } \
                              Py_INCREF(o_); Py_INCREF(o_); PyStructSequence_SetItem(r, (i), o_); \
                              PyStructSequence_SetItem(r, (j), o_); \
                              PyStructSequence_SetItem(r, (k), o_); } while (0)
#define SHARED(o) (Py_INCREF(o), (o))

/* stat(path) -> os.stat_result of a regular file; anything else goes to the fallback. */
static PyObject *Index_stat(Index *self, PyObject *path) {
    Py_ssize_t len;
    const char *key = plain_key(path, &len);
    Py_ssize_t e = (key != NULL && self->held) ? find_key(self, key, len) : -1;
    if (e < 0 || ((const uint8_t *)self->kind.buf)[e] != KIND_FILE)
        return PyObject_CallOneArg(self->fallback_stat, path);
    uint64_t size = ((const uint64_t *)self->size.buf)[e];
    int64_t ns = ((const int64_t *)self->mtime.buf)[e];
    uint32_t mode = ((const uint32_t *)self->mode.buf)[e];
    int64_t sec = ns / 1000000000, nsec = ns % 1000000000;  /* floored, as Python's // */
    if (nsec < 0) { sec -= 1; nsec += 1000000000; }
    double fsec = (double)sec + (double)nsec * 1e-9;
    PyObject *r = PyStructSequence_New(self->stat_type);
    if (r == NULL) return NULL;
    SET(0, PyLong_FromUnsignedLong(mode));
    SET(1, PyLong_FromSsize_t(e + 1));
    SET(2, SHARED(self->dev_o));
    SET(3, PyLong_FromLong(1));
    SET(4, SHARED(self->uid_o));
    SET(5, SHARED(self->gid_o));
    SET(6, PyLong_FromUnsignedLongLong(size));
    SET3(7, 8, 9, PyLong_FromLongLong(sec));
    SET3(10, 11, 12, PyFloat_FromDouble(fsec));
    SET3(13, 14, 15, PyLong_FromLongLong(ns));
    /* the preferred I/O size, as namespace.py's blksize() says */
    SET(16, SHARED(self->piece_size > 0 && size > (uint64_t)self->piece_size ? self->piece_o
                                                                        : self->blksize_o));
    SET(17, PyLong_FromUnsignedLongLong((size + 511) >> 9));
    SET(18, PyLong_FromLong(0));
    return r;
}

static PyObject *Index_release(Index *self, PyObject *unused) {
    release(self);
    Py_RETURN_NONE;
}

static PyMethodDef Index_methods[] = {
    {"find", (PyCFunction)Index_find, METH_O, "entry of a regular file at a plain path, or -1"},
    {"lookup", (PyCFunction)Index_lookup, METH_O, "entry of an exact key (bytes), or -1"},
    {"stat", (PyCFunction)Index_stat, METH_O, "os.stat_result of a path"},
    {"release", (PyCFunction)Index_release, METH_NOARGS, "let go of the manifest's buffers"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "stagefs._speedups.Index",
    .tp_basicsize = sizeof(Index),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Index_init,
    .tp_dealloc = (destructor)Index_dealloc,
    .tp_methods = Index_methods,
    .tp_doc = "Index(slots, hashes, path_off, strings, kind, mode, size, mtime_ns, "
              "stat_result, fallback_stat, dev, uid, gid, piece_size)",
};

/* xxh3_64(data) -> int: the hash the index probes with (tests compare it with xxhash's). */
static PyObject *mod_xxh3_64(PyObject *m, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0) return NULL;
    uint64_t h = xxh3_64(b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

/* ---- gather: many stored files read at once, each hashed as its bytes arrive ------------
 *
 * gather(sources, offsets, lengths, slow_s=-1.0, copy_rate=1.0) -> (datas, sums, done, waited)
 *
 * sources[i] is an int (a file descriptor: preadv; -1: none, the item is None) or a
 * bytes-like object (a mapping of a copy: memcpy); item i is lengths[i] bytes at offsets[i] of it. Items next to each other in
 * one file (the same fd, each starting where the one before ends) are read with one preadv
 * into their own bytes objects (at most IOV_MAX items, COALESCE bytes). Each item's XXH3-64
 * is taken right after its read, while its bytes are in the CPU's cache. The interpreter
 * lock is let go for all the reads and hashes (other threads run meanwhile).
 *
 * datas[i]: the bytes, or None if they could not all be read (an error, the file or the
 * mapping ended first, the mapping's file cut short under the copy: the caller reads that item again by its one-item path, which says
 * what is wrong); sums[i]: the hash, or 0. With slow_s >= 0, the reads stop after the first
 * one that waited (took longer than slow_s + its bytes / copy_rate: a file system's latency,
 * not a copy from memory); done: the items read (the rest are None); waited: whether the
 * last read waited. Python fallback with
 * the same results: tiers/base.py gather. */

enum { COALESCE = 8 << 20 };

/* A mapping's file cut short by another process (something outside stagefs writing into a
 * tier directory) turns a copy out of the mapping into a SIGBUS. A copy is guarded: the
 * handler, installed by the first gather given a mapping, jumps back out of the copy of the
 * thread that faulted, and that item is None (read again by its one-item path, which finds
 * the copy cut short and drops it). A SIGBUS outside a guarded copy goes to the disposition
 * there was before (the default: the process dies of it, as without the handler). */
static _Thread_local sigjmp_buf *volatile bus_jump;
static struct sigaction bus_before;
static int bus_installed;  /* under the interpreter lock */

static void on_sigbus(int sig, siginfo_t *info, void *ctx) {
    sigjmp_buf *jump = bus_jump;
    if (jump != NULL) {
        bus_jump = NULL;
        siglongjmp(*jump, 1);
    }
    if (bus_before.sa_flags & SA_SIGINFO) {
        if (bus_before.sa_sigaction != NULL) {
            bus_before.sa_sigaction(sig, info, ctx);
            return;
        }
    } else if (bus_before.sa_handler != SIG_DFL && bus_before.sa_handler != SIG_IGN) {
        bus_before.sa_handler(sig);
        return;
    }
    /* the default: return to the faulting access, which faults again and ends the process */
    signal(SIGBUS, SIG_DFL);
}

static int guard_install(void) {
    if (bus_installed) return 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;  /* NODEFER: SIGBUS is not left blocked by the jump */
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &bus_before) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    bus_installed = 1;
    return 0;
}

/* memcpy that returns 0 instead of dying when the source's pages are gone (see above). */
static __attribute__((noinline)) int guarded_copy(char *dst, const char *src, size_t n) {
    sigjmp_buf jump;
    if (sigsetjmp(jump, 0) != 0) return 0;
    bus_jump = &jump;
    memcpy(dst, src, n);
    bus_jump = NULL;
    return 1;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static PyObject *mod_gather(PyObject *m, PyObject *args) {
    PyObject *srcs, *offs, *lens;
    double slow_s = -1.0, copy_rate = 1.0;
    if (!PyArg_ParseTuple(args, "OOO|dd", &srcs, &offs, &lens, &slow_s, &copy_rate)) return NULL;
    PyObject *s_f = PySequence_Fast(srcs, "sources must be a sequence");
    if (s_f == NULL) return NULL;
    PyObject *o_f = PySequence_Fast(offs, "offsets must be a sequence");
    PyObject *l_f = o_f ? PySequence_Fast(lens, "lengths must be a sequence") : NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(s_f);
    PyObject *result = NULL, *datas = NULL, *sums = NULL;
    long long *fd = NULL, *off = NULL, *len = NULL;
    Py_buffer *bufs = NULL;
    char *ok = NULL;
    PyObject **out = NULL;
    uint64_t *hash = NULL;
    Py_ssize_t done = n, k;
    int waited = 0;
    if (l_f == NULL) goto end;
    if (PySequence_Fast_GET_SIZE(o_f) != n || PySequence_Fast_GET_SIZE(l_f) != n) {
        PyErr_SetString(PyExc_ValueError, "sources, offsets and lengths differ in length");
        goto end;
    }
    fd = PyMem_Calloc((size_t)n + 1, sizeof *fd);
    off = PyMem_Calloc((size_t)n + 1, sizeof *off);
    len = PyMem_Calloc((size_t)n + 1, sizeof *len);
    bufs = PyMem_Calloc((size_t)n + 1, sizeof *bufs);
    ok = PyMem_Calloc((size_t)n + 1, 1);
    out = PyMem_Calloc((size_t)n + 1, sizeof *out);
    hash = PyMem_Calloc((size_t)n + 1, sizeof *hash);
    if (!fd || !off || !len || !bufs || !ok || !out || !hash) { PyErr_NoMemory(); goto end; }
    for (k = 0; k < n; k++) {
        PyObject *s = PySequence_Fast_GET_ITEM(s_f, k);
        off[k] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(o_f, k));
        len[k] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(l_f, k));
        if (PyErr_Occurred()) goto end;
        if (off[k] < 0 || len[k] < 0 || len[k] > PY_SSIZE_T_MAX || off[k] > LLONG_MAX - len[k]) {
            PyErr_Format(PyExc_ValueError, "item %zd: offset %lld, length %lld", k, off[k],
                         len[k]);
            goto end;
        }
        if (PyLong_Check(s)) {
            fd[k] = PyLong_AsLongLong(s);  /* -1: no source, the item is None */
            if (fd[k] < -1 || fd[k] > INT_MAX) {
                if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "item %zd: fd %lld", k, fd[k]);
                goto end;
            }
        } else {
            fd[k] = -2;
            if (guard_install() < 0) goto end;
            if (PyObject_GetBuffer(s, &bufs[k], PyBUF_SIMPLE) < 0) goto end;
        }
        out[k] = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)len[k]);
        if (out[k] == NULL) goto end;
    }
    Py_BEGIN_ALLOW_THREADS
    struct iovec iov[64];
    k = 0;
    while (k < n) {
        double t0 = slow_s >= 0 ? now_s() : 0.0;
        long long nbytes = 0;
        Py_ssize_t j = k + 1;
        if (fd[k] == -1) {
            nbytes = 0;  /* no source: None */
        } else if (fd[k] == -2) {  /* a mapping: copy */
            if (off[k] + len[k] <= (long long)bufs[k].len
                && guarded_copy(PyBytes_AS_STRING(out[k]), (const char *)bufs[k].buf + off[k],
                                (size_t)len[k])) {
                ok[k] = 1;
                nbytes = len[k];
            }
        } else {  /* a file: the run of items next to each other, with one preadv */
            long long end_ = off[k] + len[k];
            nbytes = len[k];
            while (j < n && j - k < 64 && fd[j] == fd[k] && off[j] == end_
                   && nbytes + len[j] <= COALESCE) {
                end_ += len[j];
                nbytes += len[j];
                j++;
            }
            for (Py_ssize_t i = k; i < j; i++) {
                iov[i - k].iov_base = PyBytes_AS_STRING(out[i]);
                iov[i - k].iov_len = (size_t)len[i];
            }
            struct iovec *v = iov;
            int nv = (int)(j - k);
            long long pos = off[k], left = nbytes;
            while (left > 0 && nv > 0) {
                ssize_t got = preadv((int)fd[k], v, nv, (off_t)pos);
                if (got < 0 && errno == EINTR) continue;
                if (got <= 0) break;  /* an error, or the file ended: these items are None */
                pos += got;
                left -= got;
                while (nv > 0 && (size_t)got >= v->iov_len) { got -= (ssize_t)v->iov_len; v++; nv--; }
                if (nv > 0 && got > 0) {
                    v->iov_base = (char *)v->iov_base + got;
                    v->iov_len -= (size_t)got;
                }
            }
            /* the items read whole; zero-length items always are */
            long long filled = nbytes - left;
            for (Py_ssize_t i = k; i < j; i++) {
                if (len[i] <= filled) ok[i] = 1;
                filled -= len[i];
                if (filled < 0) filled = -1;
            }
        }
        for (Py_ssize_t i = k; i < j; i++)
            if (ok[i]) hash[i] = xxh3_64((const uint8_t *)PyBytes_AS_STRING(out[i]), (size_t)len[i]);
        k = j;
        if (slow_s >= 0 && now_s() - t0 > slow_s + (double)nbytes / copy_rate) {
            done = k;
            waited = 1;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    datas = PyList_New(n);
    sums = PyList_New(n);
    if (datas == NULL || sums == NULL) goto end;
    for (k = 0; k < n; k++) {
        PyObject *h = PyLong_FromUnsignedLongLong(ok[k] ? hash[k] : 0);
        if (h == NULL) goto end;
        PyList_SET_ITEM(sums, k, h);
        if (ok[k]) {
            PyList_SET_ITEM(datas, k, out[k]);
            out[k] = NULL;
        } else {
            Py_INCREF(Py_None);
            PyList_SET_ITEM(datas, k, Py_None);
        }
    }
    result = Py_BuildValue("(OOnO)", datas, sums, done, waited ? Py_True : Py_False);
end:
    Py_XDECREF(datas);
    Py_XDECREF(sums);
    for (k = 0; bufs && out && k < n; k++) {
        if (bufs[k].obj != NULL) PyBuffer_Release(&bufs[k]);
        Py_XDECREF(out[k]);
    }
    PyMem_Free(fd); PyMem_Free(off); PyMem_Free(len); PyMem_Free(bufs); PyMem_Free(ok);
    PyMem_Free(out); PyMem_Free(hash);
    Py_XDECREF(s_f); Py_XDECREF(o_f); Py_XDECREF(l_f);
    return result;
}

static PyMethodDef module_methods[] = {
    {"xxh3_64", mod_xxh3_64, METH_O, "XXH3-64 (seed 0) of a bytes-like object"},
    {"gather", mod_gather, METH_VARARGS,
     "gather(sources, offsets, lengths, slow_s=-1.0, copy_rate=1.0) -> (datas, sums, done, "
     "waited)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_speedups", NULL, -1,
                                    module_methods};

PyMODINIT_FUNC PyInit__speedups(void) {
    if (PyType_Ready(&IndexType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&IndexType);
    if (PyModule_AddObject(m, "Index", (PyObject *)&IndexType) < 0) {
        Py_DECREF(&IndexType); Py_DECREF(m); return NULL;
    }
    return m;
}
