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
#include <stdint.h>
#include <string.h>

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

static PyMethodDef module_methods[] = {
    {"xxh3_64", mod_xxh3_64, METH_O, "XXH3-64 (seed 0) of a bytes-like object"},
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
