/* XXH3-64 (seed 0, default secret), shared by the C accelerator (_speedups.c) and the
 * preload library (posix/preload.c): one implementation of the hash in C. */
#ifndef STAGEFS_XXH3_H
#define STAGEFS_XXH3_H
#include <stddef.h>
#include <stdint.h>

/* ---- XXH3-64 (seed 0, default secret): the manifest's hash of a path -------------------
 *
 * Written from the published xxHash specification (doc/xxhash_spec.md, "XXH3 algorithm
 * description"), so neither C part needs a header beyond libc's: the manifest stores
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
 * the 192-byte secret), a scramble after each block but the last. This loop is where a
 * checksum of a large file spends its time, so it has four forms computing the same
 * accumulators: plain C (any CPU), SSE2 (every x86-64), AVX2 and AVX-512 (chosen at run
 * time: AVX-512 hashed a 110 KB sample in 0.7 of AVX2's time on this project's machine;
 * the xxhash package uses it there too); a test compiles each with XXH3_FORCE and
 * checks it against the xxhash package. */
enum { STRIPE = 64, STRIPES_PER_BLOCK = (sizeof SECRET - 64) / 8, BLOCK = STRIPE * STRIPES_PER_BLOCK };
#define SCRAMBLE_SECRET (SECRET + sizeof SECRET - 64)
#define LAST_SECRET (SECRET + sizeof SECRET - 71)

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !(defined(XXH3_FORCE) && XXH3_FORCE == 0)
#define XXH3_X86 1
#include <immintrin.h>

/* The same loop on 128-bit lanes (two accumulators each): acc[i] += lo32(v) * hi32(v) is
 * _mm_mul_epu32 of v and v with its halves swapped; acc[i ^ 1] += d is d with its two
 * 64-bit halves swapped. */
static inline __m128i acc_sse2(__m128i acc, const uint8_t *in, const uint8_t *sec) {
    __m128i d = _mm_loadu_si128((const __m128i *)in);
    __m128i v = _mm_xor_si128(d, _mm_loadu_si128((const __m128i *)sec));
    __m128i prod = _mm_mul_epu32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(0, 3, 0, 1)));
    return _mm_add_epi64(prod, _mm_add_epi64(acc, _mm_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2))));
}

static inline __m128i scramble_sse2(__m128i acc, const uint8_t *sec) {
    __m128i v = _mm_xor_si128(_mm_xor_si128(acc, _mm_srli_epi64(acc, 47)),
                              _mm_loadu_si128((const __m128i *)sec));
    __m128i p = _mm_set1_epi32((int)P32_1);
    __m128i lo = _mm_mul_epu32(v, p);
    __m128i hi = _mm_mul_epu32(_mm_shuffle_epi32(v, _MM_SHUFFLE(0, 3, 0, 1)), p);
    return _mm_add_epi64(lo, _mm_slli_epi64(hi, 32));
}

static void xxh3_acc_sse2(uint64_t acc64[8], const uint8_t *in, size_t len) {
    __m128i a[4];
    for (int j = 0; j < 4; j++) a[j] = _mm_loadu_si128((const __m128i *)(acc64 + 2 * j));
    size_t done = 0;
    for (; len - done > BLOCK; done += BLOCK) {
        for (size_t n = 0; n < STRIPES_PER_BLOCK; n++)
            for (int j = 0; j < 4; j++)
                a[j] = acc_sse2(a[j], in + done + n * STRIPE + 16 * j, SECRET + n * 8 + 16 * j);
        for (int j = 0; j < 4; j++) a[j] = scramble_sse2(a[j], SCRAMBLE_SECRET + 16 * j);
    }
    size_t full = (len - done - 1) / STRIPE;
    for (size_t n = 0; n < full; n++)
        for (int j = 0; j < 4; j++)
            a[j] = acc_sse2(a[j], in + done + n * STRIPE + 16 * j, SECRET + n * 8 + 16 * j);
    for (int j = 0; j < 4; j++) a[j] = acc_sse2(a[j], in + len - STRIPE + 16 * j, LAST_SECRET + 16 * j);
    for (int j = 0; j < 4; j++) _mm_storeu_si128((__m128i *)(acc64 + 2 * j), a[j]);
}

#define AVX2 __attribute__((target("avx2")))
static inline AVX2 __m256i acc_avx2(__m256i acc, const uint8_t *in, const uint8_t *sec) {
    __m256i d = _mm256_loadu_si256((const __m256i *)in);
    __m256i v = _mm256_xor_si256(d, _mm256_loadu_si256((const __m256i *)sec));
    __m256i prod = _mm256_mul_epu32(v, _mm256_shuffle_epi32(v, _MM_SHUFFLE(0, 3, 0, 1)));
    return _mm256_add_epi64(prod, _mm256_add_epi64(acc, _mm256_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2))));
}

static inline AVX2 __m256i scramble_avx2(__m256i acc, const uint8_t *sec) {
    __m256i v = _mm256_xor_si256(_mm256_xor_si256(acc, _mm256_srli_epi64(acc, 47)),
                                 _mm256_loadu_si256((const __m256i *)sec));
    __m256i p = _mm256_set1_epi32((int)P32_1);
    __m256i lo = _mm256_mul_epu32(v, p);
    __m256i hi = _mm256_mul_epu32(_mm256_shuffle_epi32(v, _MM_SHUFFLE(0, 3, 0, 1)), p);
    return _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
}

static AVX2 void xxh3_acc_avx2(uint64_t acc64[8], const uint8_t *in, size_t len) {
    __m256i a0 = _mm256_loadu_si256((const __m256i *)acc64);
    __m256i a1 = _mm256_loadu_si256((const __m256i *)(acc64 + 4));
    size_t done = 0;
    for (; len - done > BLOCK; done += BLOCK) {
        for (size_t n = 0; n < STRIPES_PER_BLOCK; n++) {
            a0 = acc_avx2(a0, in + done + n * STRIPE, SECRET + n * 8);
            a1 = acc_avx2(a1, in + done + n * STRIPE + 32, SECRET + n * 8 + 32);
        }
        a0 = scramble_avx2(a0, SCRAMBLE_SECRET);
        a1 = scramble_avx2(a1, SCRAMBLE_SECRET + 32);
    }
    size_t full = (len - done - 1) / STRIPE;
    for (size_t n = 0; n < full; n++) {
        a0 = acc_avx2(a0, in + done + n * STRIPE, SECRET + n * 8);
        a1 = acc_avx2(a1, in + done + n * STRIPE + 32, SECRET + n * 8 + 32);
    }
    a0 = acc_avx2(a0, in + len - STRIPE, LAST_SECRET);
    a1 = acc_avx2(a1, in + len - STRIPE + 32, LAST_SECRET + 32);
    _mm256_storeu_si256((__m256i *)acc64, a0);
    _mm256_storeu_si256((__m256i *)(acc64 + 4), a1);
}

/* The same loop on one 512-bit register: all eight accumulators. */
#define AVX512 __attribute__((target("avx512f")))
static inline AVX512 __m512i acc_avx512(__m512i acc, const uint8_t *in, const uint8_t *sec) {
    __m512i d = _mm512_loadu_si512((const void *)in);
    __m512i v = _mm512_xor_si512(d, _mm512_loadu_si512((const void *)sec));
    __m512i prod = _mm512_mul_epu32(v, _mm512_shuffle_epi32(v, (_MM_PERM_ENUM)_MM_SHUFFLE(0, 3, 0, 1)));
    return _mm512_add_epi64(prod, _mm512_add_epi64(
        acc, _mm512_shuffle_epi32(d, (_MM_PERM_ENUM)_MM_SHUFFLE(1, 0, 3, 2))));
}

static inline AVX512 __m512i scramble_avx512(__m512i acc, const uint8_t *sec) {
    __m512i v = _mm512_xor_si512(_mm512_xor_si512(acc, _mm512_srli_epi64(acc, 47)),
                                 _mm512_loadu_si512((const void *)sec));
    __m512i p = _mm512_set1_epi32((int)P32_1);
    __m512i lo = _mm512_mul_epu32(v, p);
    __m512i hi = _mm512_mul_epu32(_mm512_shuffle_epi32(v, (_MM_PERM_ENUM)_MM_SHUFFLE(0, 3, 0, 1)), p);
    return _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32));
}

static AVX512 void xxh3_acc_avx512(uint64_t acc64[8], const uint8_t *in, size_t len) {
    __m512i a = _mm512_loadu_si512((const void *)acc64);
    size_t done = 0;
    for (; len - done > BLOCK; done += BLOCK) {
        for (size_t n = 0; n < STRIPES_PER_BLOCK; n++)
            a = acc_avx512(a, in + done + n * STRIPE, SECRET + n * 8);
        a = scramble_avx512(a, SCRAMBLE_SECRET);
    }
    size_t full = (len - done - 1) / STRIPE;
    for (size_t n = 0; n < full; n++) a = acc_avx512(a, in + done + n * STRIPE, SECRET + n * 8);
    a = acc_avx512(a, in + len - STRIPE, LAST_SECRET);
    _mm512_storeu_si512((void *)acc64, a);
}

/* 3: AVX-512, 2: AVX2, 1: SSE2; asked of the CPU once (a race only writes the same value
 * twice). */
static int xxh3_level(void) {
#if defined(XXH3_FORCE)
    return XXH3_FORCE;
#else
    static int level;
    int l = __atomic_load_n(&level, __ATOMIC_RELAXED);
    if (!l) {
        __builtin_cpu_init();
        l = __builtin_cpu_supports("avx512f") ? 3 : __builtin_cpu_supports("avx2") ? 2 : 1;
        __atomic_store_n(&level, l, __ATOMIC_RELAXED);
    }
    return l;
#endif
}
#else
static void accumulate(uint64_t acc[8], const uint8_t *stripe, const uint8_t *sec) {
    for (int i = 0; i < 8; i++) {
        uint64_t d = le64(stripe + 8 * i), v = d ^ le64(sec + 8 * i);
        acc[i ^ 1] += d;
        acc[i] += (v & 0xffffffffu) * (v >> 32);
    }
}

static void xxh3_acc_scalar(uint64_t acc[8], const uint8_t *in, size_t len) {
    size_t done = 0;
    for (; len - done > BLOCK; done += BLOCK) {
        for (size_t n = 0; n < STRIPES_PER_BLOCK; n++)
            accumulate(acc, in + done + n * STRIPE, SECRET + n * 8);
        for (int i = 0; i < 8; i++) {
            acc[i] ^= acc[i] >> 47;
            acc[i] ^= le64(SCRAMBLE_SECRET + 8 * i);
            acc[i] *= P32_1;
        }
    }
    size_t full = (len - done - 1) / STRIPE;  /* the last stripe goes below, even if full */
    for (size_t n = 0; n < full; n++) accumulate(acc, in + done + n * STRIPE, SECRET + n * 8);
    accumulate(acc, in + len - STRIPE, LAST_SECRET);
}
#endif

static uint64_t xxh3_long(const uint8_t *in, size_t len) {
    uint64_t acc[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
#ifdef XXH3_X86
    int level = xxh3_level();
    if (level == 3) xxh3_acc_avx512(acc, in, len);
    else if (level == 2) xxh3_acc_avx2(acc, in, len);
    else xxh3_acc_sse2(acc, in, len);
#else
    xxh3_acc_scalar(acc, in, len);
#endif
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

#endif
