/* The decode kernel's building blocks over the paged KV cache: a key's cache slot, row
 * prefetches, the 16-lane loads and the query . key dots its AVX-512 path runs. */
#ifndef KILN_PAGED_ATTENTION_ROWS_H
#define KILN_PAGED_ATTENTION_ROWS_H

#include <stdint.h>

#include "bf16_simd.h"
#include "dtype.h"
#include "fp8_simd.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define KILN_ATTN_SIMD 1
#else
#define KILN_ATTN_SIMD 0
#endif
/* bfloat16 query . key dot products with VDPBF16PS: the cache's bytes as they are, 32 products
 * an instruction, where widening each key to float32 for FMAs cost four times the instructions
 * (the products are exact in float32 either way). Two differences, both far from real
 * activations: denormal inputs count as zero, and the sums are of unscaled products, so a score
 * overflows 1 / scale times sooner (8x at head size 64, past about 4e37) than the float32
 * path's, whose query is scaled first. */
#if KILN_ATTN_SIMD && defined(__AVX512BF16__)
#define KILN_ATTN_BF16_DOT 1
#else
#define KILN_ATTN_BF16_DOT 0
#endif


/* n values at element offset `off` of `base` as floats: a pointer into base for float32, else
 * converted into buf. */
static inline const float *row_f32(const void *base, int64_t off, int n, int dtype, float *buf) {
    if (dtype == KILN_F32) return (const float *)base + off;
    for (int i = 0; i < n; ++i) buf[i] = load_elem(base, off + i, dtype);
    return buf;
}

static inline void store_row(void *base, int64_t off, const float *src, float mul, int n,
                             int dtype) {
    if (dtype == KILN_F32) {
        float *dst = (float *)base + off;
        for (int i = 0; i < n; ++i) dst[i] = src[i] * mul;
    } else {
        uint16_t *dst = (uint16_t *)base + off;
        for (int i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i] * mul);
    }
}

/* Cache slot of key s: its block from the request's table, then the offset inside the block. */
static inline int64_t key_slot(const int32_t *blocks, int block_size, int s) {
    return (int64_t)blocks[s / block_size] * block_size + s % block_size;
}

/* Asks for key s + PREFETCH_AHEAD's rows while key s is computed: blocks are scattered, so the
 * hardware prefetcher loses the stream at every block boundary. Into L2, not L1: L1's few miss
 * buffers dropped most of the requests. Measured per layer with the caches out of L3 (9 heads of
 * 64 over 3, float32, 2 threads), ahead 8 into L1 / 16 into L2: 32 requests of 1000 keys 5.3-6.5
 * / 3.6-3.8 ms, 32 of 60 0.30 / 0.23, 8 of 250 0.41 / 0.27, 1 of 1000 0.15 / 0.125. */
#define PREFETCH_AHEAD 16

static inline void prefetch_rows(const void *cache, const int32_t *blocks, int block_size,
                                 int s, int n_keys, int64_t slot_stride, int64_t head_off,
                                 int64_t n, int elem) {
    if (s >= n_keys) return;
    const char *p = (const char *)cache +
                    (key_slot(blocks, block_size, s) * slot_stride + head_off) * elem;
    for (int64_t b = 0; b < n * elem; b += 64) __builtin_prefetch(p + b, 0, 2);
}

#if KILN_ATTN_SIMD
/* 16 values at element offset `off` of `base` (float32, bfloat16 or fp8) as floats. fp8 goes
 * through fp16, exactly: e5m2 is an fp16's top byte; e4m3fn's exponent and mantissa shifted
 * into an fp16's read as fp16 is the value times 2^-8 (its bias 7 against fp16's 15), its
 * subnormals as fp16 subnormals, so a multiply by 256 restores it. Its NaN (0x7f / 0xff: the
 * writes saturate finite values, but a NaN K/V is stored as NaN) gets fp16's all-ones exponent:
 * shifted alone it read as 480, and a NaN in the model came out as finite attention. */
static inline __m512 load16(const void *base, int64_t off, int dtype) {
    if (dtype == KILN_F32) return _mm512_loadu_ps((const float *)base + off);
    if (dtype == KILN_BF16) {
        return bf16x16_f32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off)));
    }
    const __m256i w = _mm256_cvtepu8_epi16(
        _mm_loadu_si128((const __m128i *)((const uint8_t *)base + off)));
    if (dtype == KILN_FP8E5M2) return _mm512_cvtph_ps(_mm256_slli_epi16(w, 8));
    const __m256i m7 = _mm256_and_si256(w, _mm256_set1_epi16(0x7f));
    const __m256i nan = _mm256_and_si256(_mm256_cmpeq_epi16(m7, _mm256_set1_epi16(0x7f)),
                                         _mm256_set1_epi16(0x7c00));
    const __m256i h = _mm256_or_si256(
        _mm256_or_si256(_mm256_slli_epi16(m7, 7), nan),
        _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}

static inline __m256 halves(__m512 v) {  /* v's two 8-lane halves added */
    return _mm256_add_ps(_mm512_castps512_ps256(v),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

/* The lane sums of a, b, c and d as one 4-lane vector: one reduction for four dot products
 * (reducing each alone was a quarter of the kernel's time, measured). */
static inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m256 ab = _mm256_hadd_ps(halves(a), halves(b)); /* a01 a23 b01 b23 | a45 a67 ... */
    const __m256 abcd = _mm256_hadd_ps(ab, _mm256_hadd_ps(halves(c), halves(d)));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* A query row qg (float32, pre-scaled) against the key rows at element offsets off[0..3]. */
static inline __attribute__((always_inline)) __m128 dot4(const float *qg, const void *k_cache,
                                                         const int64_t off[4], int dtype,
                                                         const int hd) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int d = 0; d < hd; d += 16) {
        const __m512 qv = _mm512_loadu_ps(qg + d);
        a0 = _mm512_fmadd_ps(qv, load16(k_cache, off[0] + d, dtype), a0);
        a1 = _mm512_fmadd_ps(qv, load16(k_cache, off[1] + d, dtype), a1);
        a2 = _mm512_fmadd_ps(qv, load16(k_cache, off[2] + d, dtype), a2);
        a3 = _mm512_fmadd_ps(qv, load16(k_cache, off[3] + d, dtype), a3);
    }
    return sum4(a0, a1, a2, a3);
}

#if KILN_ATTN_BF16_DOT
/* Query heads of a GQA group whose scores one pass over a chunk's key rows computes: their 8
 * sums each, 24 registers at 3 beside 6 of queries and 4 of keys (GCC spills 3; tiles of 2, which
 * read the keys twice for SmolLM2's group of 3, took 7% longer). */
#define DOT_TILE 3

/* A bfloat16 query row q [hd] as dots16_bf16 reads it, into qx [2 * hd]: each 32 dims' first 16
 * twice (both 256-bit halves of a register), then their last 16 twice. */
static inline void pair_query(const uint16_t *q, uint16_t *qx, int hd) {
    for (int d = 0; d < hd; d += 32)
        for (int h = 0; h < 2; ++h)
            _mm512_storeu_si512(qx + 2 * d + 32 * h,
                                _mm512_broadcast_i64x4(
                                    _mm256_loadu_si256((const __m256i *)(q + d + 16 * h))));
}

/* The 16 keys' dot products, lane j key j's, from c[0..7], each 256-bit half of which holds 8
 * sums of one key's: c[i]'s keys i and i + 4 for i < 4, i + 4 and i + 8 else (the order in which
 * the tree leaves them in key order). */
static inline __attribute__((always_inline)) __m512 sum8_halves(const __m512 *c) {
    __m512 d[4], e[2];
    for (int i = 0; i < 4; ++i) /* d[i]: 128-bit lanes of keys i, i + 8, i + 4, i + 12 */
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[i], c[i + 4], 0x88),
                             _mm512_shuffle_f32x4(c[i], c[i + 4], 0xdd));
    for (int i = 0; i < 2; ++i) { /* e[i]: in each 128-bit lane, pairs of keys */
        const __m512d x = _mm512_castps_pd(d[2 * i]), y = _mm512_castps_pd(d[2 * i + 1]);
        e[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    return _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x88), _mm512_shuffle_ps(e[0], e[1], 0xdd));
}

/* `rows` (<= DOT_TILE) query heads of one kv head, in pair_query's form 2 * hd apart, against 16
 * key rows of a bfloat16 cache (or rows converted to it), key j's at element offset off + j *
 * stride, or key n - 1's from j = n on: their scores times scale into p [rows, 16]. hd a multiple
 * of 32. Each 32 dims of two keys a, b become two registers, [a's first 16 | b's first 16] and
 * [a's last 16 | b's last 16] (a 128-bit-lane shuffle each), read by all the rows, whose
 * products so land in 8 vectors of two keys' sums: 21 shuffles and adds a row from there to 16
 * scores, where a vector per key (16) took 46 (and each row read the keys again). */
static inline __attribute__((always_inline)) void dots16_bf16(const uint16_t *qx,
                                                              const uint16_t *k, int64_t off,
                                                              int64_t stride, int n, float scale,
                                                              float *p, const int rows,
                                                              const int hd) {
    __m512 c[DOT_TILE][8];
    for (int r = 0; r < rows; ++r)
        for (int i = 0; i < 8; ++i) c[r][i] = _mm512_setzero_ps();
    for (int d = 0; d < hd; d += 32) {
        __m512bh qa[DOT_TILE], qb[DOT_TILE]; /* each row's first and last 16 dims, twice */
        for (int r = 0; r < rows; ++r) {
            qa[r] = (__m512bh)_mm512_loadu_si512(qx + (int64_t)r * 2 * hd + 2 * d);
            qb[r] = (__m512bh)_mm512_loadu_si512(qx + (int64_t)r * 2 * hd + 2 * d + 32);
        }
        for (int i = 0; i < 8; ++i) {
            const int ka = (i & 3) + (i & 4 ? 8 : 0), kb = ka + 4; /* sum8_halves' order */
            const __m512i a = _mm512_loadu_si512(k + off + (ka < n ? ka : n - 1) * stride + d);
            const __m512i b = _mm512_loadu_si512(k + off + (kb < n ? kb : n - 1) * stride + d);
            const __m512bh x = (__m512bh)_mm512_shuffle_i32x4(a, b, 0x44);
            const __m512bh y = (__m512bh)_mm512_shuffle_i32x4(a, b, 0xee);
            for (int r = 0; r < rows; ++r)
                c[r][i] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(c[r][i], x, qa[r]), y, qb[r]);
        }
    }
    for (int r = 0; r < rows; ++r)
        _mm512_storeu_ps(p + r * 16,
                         _mm512_mul_ps(sum8_halves(c[r]), _mm512_set1_ps(scale)));
}
#else
/* never taken: bf16_dot is 0 */
#define DOT_TILE 1
#define pair_query(q, qx, hd) ((void)0)
#define dots16_bf16(qx, k, off, stride, n, scale, p, rows, hd)                                   \
    ((void)(qx), (void)(k), (void)(off), (void)(stride), (void)(scale), (void)(p))
#endif
#endif

#endif
