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

/* ---- XXH3-64 (seed 0, default secret): the manifest's hash of a path -------------------
 *
 * Written from the published xxHash specification (doc/xxhash_spec.md, "XXH3 algorithm
 * description"), so the accelerator needs no header beyond Python's: the manifest stores
 * xxh3_64 of each path (format/manifest.py, via the xxhash package) and a lookup must
 * compute the same value. tests/unit/test_speedups.py checks it against the xxhash package
 * at every length that picks a different branch. Plain C: portable 64x64->128 multiply and
 * byte-by-byte little-endian reads (compilers turn both into single instructions). */

static const uint8_t SECRET[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};
#define P32_1 0x9E3779B1U
#define P32_2 0x85EBCA77U
#define P32_3 0xC2B2AE3DU
#define P64_1 0x9E3779B185EBCA87ULL
#define P64_2 0xC2B2AE3D27D4EB4FULL
#define P64_3 0x165667B19E3779F9ULL
#define P64_4 0x85EBCA77C2B2AE63ULL
#define P64_5 0x27D4EB2F165667C5ULL
#define PMX_1 0x165667919E3779F9ULL
#define PMX_2 0x9FB21C651E98DF25ULL

static inline uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline uint64_t le64(const uint8_t *p) { return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32; }
static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
static inline uint64_t bswap64(uint64_t x) {
    uint64_t r = 0;
    for (int k = 0; k < 8; k++) r = (r << 8) | ((x >> (8 * k)) & 0xff);
    return r;
}

/* The 128-bit product of a and b, folded: low half xor high half. */
static inline uint64_t mul_fold(uint64_t a, uint64_t b) {
    uint64_t al = a & 0xffffffffu, ah = a >> 32, bl = b & 0xffffffffu, bh = b >> 32;
    uint64_t ll = al * bl, lh = al * bh, hl = ah * bl, hh = ah * bh;
    uint64_t mid = (ll >> 32) + (lh & 0xffffffffu) + (hl & 0xffffffffu);
    uint64_t lo = (mid << 32) | (ll & 0xffffffffu);
    uint64_t hi = hh + (lh >> 32) + (hl >> 32) + (mid >> 32);
    return lo ^ hi;
}

static inline uint64_t avalanche(uint64_t x) {
    x ^= x >> 37; x *= PMX_1; return x ^ (x >> 32);
}
static inline uint64_t avalanche_xxh64(uint64_t x) {
    x ^= x >> 33; x *= P64_2; x ^= x >> 29; x *= P64_3; return x ^ (x >> 32);
}
/* 16 bytes of input against 16 bytes of the secret (seed 0) */
static inline uint64_t mix16(const uint8_t *in, const uint8_t *sec) {
    return mul_fold(le64(in) ^ le64(sec), le64(in + 8) ^ le64(sec + 8));
}

static uint64_t xxh3_0to16(const uint8_t *in, size_t len) {
    if (len > 8) {
        uint64_t lo = (le64(SECRET + 24) ^ le64(SECRET + 32)) ^ le64(in);
        uint64_t hi = (le64(SECRET + 40) ^ le64(SECRET + 48)) ^ le64(in + len - 8);
        return avalanche((uint64_t)len + bswap64(lo) + hi + mul_fold(lo, hi));
    }
    if (len >= 4) {
        uint64_t v = (le64(SECRET + 8) ^ le64(SECRET + 16)) ^
                     ((uint64_t)le32(in + len - 4) | (uint64_t)le32(in) << 32);
        v ^= rotl64(v, 49) ^ rotl64(v, 24);
        v *= PMX_2;
        v ^= (v >> 35) + (uint64_t)len;
        v *= PMX_2;
        return v ^ (v >> 28);
    }
    if (len > 0) {
        uint32_t c = (uint32_t)in[len - 1] | (uint32_t)len << 8 | (uint32_t)in[0] << 16 |
                     (uint32_t)in[len >> 1] << 24;
        return avalanche_xxh64((uint64_t)(le32(SECRET) ^ le32(SECRET + 4)) ^ (uint64_t)c);
    }
    return avalanche_xxh64(le64(SECRET + 56) ^ le64(SECRET + 64));
}

static uint64_t xxh3_17to240(const uint8_t *in, size_t len) {
    uint64_t acc = (uint64_t)len * P64_1;
    if (len <= 128) {
        for (size_t i = ((len - 1) >> 5) + 1; i-- > 0;) {
            acc += mix16(in + 16 * i, SECRET + 32 * i);
            acc += mix16(in + len - 16 * i - 16, SECRET + 32 * i + 16);
        }
        return avalanche(acc);
    }
    for (size_t i = 0; i < 8; i++) acc += mix16(in + 16 * i, SECRET + 16 * i);
    acc = avalanche(acc);
    for (size_t i = 8; i < len / 16; i++) acc += mix16(in + 16 * i, SECRET + 16 * (i - 8) + 3);
    acc += mix16(in + len - 16, SECRET + 119);
    return avalanche(acc);
}

/* Inputs over 240 bytes: 8 accumulators, 64-byte stripes, 1024-byte blocks (16 stripes for
 * the 192-byte secret), a scramble after each block but the last. */
enum { STRIPE = 64, STRIPES_PER_BLOCK = (sizeof SECRET - 64) / 8, BLOCK = STRIPE * STRIPES_PER_BLOCK };

static void accumulate(uint64_t acc[8], const uint8_t *stripe, const uint8_t *sec) {
    for (int i = 0; i < 8; i++) {
        uint64_t d = le64(stripe + 8 * i), v = d ^ le64(sec + 8 * i);
        acc[i ^ 1] += d;
        acc[i] += (v & 0xffffffffu) * (v >> 32);
    }
}

static uint64_t xxh3_long(const uint8_t *in, size_t len) {
    uint64_t acc[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    size_t done = 0;
    for (; len - done > BLOCK; done += BLOCK) {
        for (size_t n = 0; n < STRIPES_PER_BLOCK; n++)
            accumulate(acc, in + done + n * STRIPE, SECRET + n * 8);
        const uint8_t *sec = SECRET + sizeof SECRET - 64;
        for (int i = 0; i < 8; i++) {
            acc[i] ^= acc[i] >> 47;
            acc[i] ^= le64(sec + 8 * i);
            acc[i] *= P32_1;
        }
    }
    size_t full = (len - done - 1) / STRIPE;  /* the last stripe goes below, even if full */
    for (size_t n = 0; n < full; n++) accumulate(acc, in + done + n * STRIPE, SECRET + n * 8);
    accumulate(acc, in + len - STRIPE, SECRET + sizeof SECRET - 71);
    uint64_t r = (uint64_t)len * P64_1;
    for (int i = 0; i < 4; i++)
        r += mul_fold(acc[2 * i] ^ le64(SECRET + 11 + 16 * i), acc[2 * i + 1] ^ le64(SECRET + 19 + 16 * i));
    return avalanche(r);
}

static uint64_t xxh3_64(const void *data, size_t len) {
    const uint8_t *in = data;
    if (len <= 16) return xxh3_0to16(in, len);
    if (len <= 240) return xxh3_17to240(in, len);
    return xxh3_long(in, len);
}

enum { KIND_FILE = 0 };

typedef struct {
    PyObject_HEAD
    Py_buffer slots, hashes, path_off, strings, kind, mode, size, mtime;
    int held;
    uint64_t mask;
    Py_ssize_t n;  /* entries */
    PyTypeObject *stat_type;
    PyObject *fallback_stat;
    long long dev, uid, gid;
    PyObject *dev_o, *uid_o, *gid_o, *blksize_o;  /* the same in every result: made once */
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
    Py_XDECREF(self->gid_o); Py_XDECREF(self->blksize_o);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int get(PyObject *arr, Py_buffer *view) {
    return PyObject_GetBuffer(arr, view, PyBUF_C_CONTIGUOUS);
}

static int Index_init(Index *self, PyObject *args, PyObject *kw) {
    PyObject *slots, *hashes, *path_off, *strings, *kind, *mode, *size, *mtime, *stat_type,
        *fallback;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOLLL", &slots, &hashes, &path_off, &strings, &kind,
                          &mode, &size, &mtime, &stat_type, &fallback, &self->dev, &self->uid,
                          &self->gid))
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
    if (!self->dev_o || !self->uid_o || !self->gid_o || !self->blksize_o) return -1;
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
    SET(16, SHARED(self->blksize_o));
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
              "stat_result, fallback_stat, dev, uid, gid)",
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
