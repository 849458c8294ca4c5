/* The decode kernel's building blocks over the paged KV cache: a key's cache slot, row
 * prefetches, and the 16-lane loads, query . key dots and P . V tiles paged_attention.c runs. */
#ifndef KILN_PAGED_ATTENTION_ROWS_H
#define KILN_PAGED_ATTENTION_ROWS_H

#include <stdint.h>

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
        const __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
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
/* dot4 of a bfloat16 query row (unscaled: the scale goes on the sums) against a bfloat16 cache,
 * hd a multiple of 32. */
static inline __attribute__((always_inline)) __m128 dot4_bf16(const uint16_t *qg,
                                                              const void *k_cache,
                                                              const int64_t off[4], float scale,
                                                              const int hd) {
    const uint16_t *k = (const uint16_t *)k_cache;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int d = 0; d < hd; d += 32) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(qg + d);
        a0 = _mm512_dpbf16_ps(a0, qv, (__m512bh)_mm512_loadu_si512(k + off[0] + d));
        a1 = _mm512_dpbf16_ps(a1, qv, (__m512bh)_mm512_loadu_si512(k + off[1] + d));
        a2 = _mm512_dpbf16_ps(a2, qv, (__m512bh)_mm512_loadu_si512(k + off[2] + d));
        a3 = _mm512_dpbf16_ps(a3, qv, (__m512bh)_mm512_loadu_si512(k + off[3] + d));
    }
    return _mm_mul_ps(sum4(a0, a1, a2, a3), _mm_set1_ps(scale));
}
#else
#define dot4_bf16(qg, k_cache, off, scale, hd) _mm_setzero_ps() /* never taken: bf16_dot is 0 */
#endif
#endif


#if KILN_ATTN_SIMD && KILN_FP8_SIMD
/* pv_tile over an fp8 cache, hd a multiple of 32: each 32 values of a row by table as bfloat16,
 * widened to float32 in two registers of its even and odd dims (a shift, a mask), so the sums
 * are kept in that order and put back in dim order at the end. */
static inline __attribute__((always_inline)) void pv_tile_fp8(
    const float *p, int k0, int nk, const void *v_cache, const int64_t *slots,
    int64_t slot_stride, int64_t h_off, const int32_t *blocks, int block_size, int dtype,
    float *o, const int rows, const int hd) {
    const Fp8Tab tab = fp8_tab(dtype);
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
    __m512 out[4][8]; /* [r][2c]: dims 32c + 2i, [r][2c + 1]: dims 32c + 2i + 1 */
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < hd / 16; ++c) out[r][c] = _mm512_setzero_ps();
    for (int s = 0; s < nk; ++s) {
        prefetch_rows(v_cache, blocks, block_size, k0 + s + PREFETCH_AHEAD, k0 + nk, slot_stride,
                      h_off, hd, 1);
        const uint8_t *row = (const uint8_t *)v_cache + slots[s] * slot_stride + h_off;
        for (int c = 0; c < hd / 32; ++c) {
            const __m512i w = fp8x32_bf16(row + 32 * c, &tab);
            const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
            const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(w, top));
            for (int r = 0; r < rows; ++r) {
                const __m512 pr = _mm512_set1_ps(p[(int64_t)r * nk + s]);
                out[r][2 * c] = _mm512_fmadd_ps(pr, even, out[r][2 * c]);
                out[r][2 * c + 1] = _mm512_fmadd_ps(pr, odd, out[r][2 * c + 1]);
            }
        }
    }
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < hd / 32; ++c) {
            float *dst = o + (int64_t)r * hd + 32 * c;
            _mm512_storeu_ps(dst, _mm512_permutex2var_ps(out[r][2 * c], lo, out[r][2 * c + 1]));
            _mm512_storeu_ps(dst + 16,
                             _mm512_permutex2var_ps(out[r][2 * c], hi, out[r][2 * c + 1]));
        }
}
#endif

#if KILN_ATTN_SIMD
/* o [rows, hd] = sum over keys k0 + s (s < nk) of p [rows, nk] (s) * that key's value row (at
 * head offset h_off), for `rows` query heads sharing that kv head; slots relative to k0 too.
 * hd <= 128, a multiple of 16. */
static inline __attribute__((always_inline)) void pv_tile(
    const float *p, int k0, int nk, const void *v_cache, const int64_t *slots,
    int64_t slot_stride, int64_t h_off, const int32_t *blocks, int block_size, int dtype,
    float *o, const int rows, const int hd) {
    __m512 out[4][8];
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < hd / 16; ++c) out[r][c] = _mm512_setzero_ps();
#if KILN_FP8_SIMD
    if (dtype == KILN_FP8E4M3 && hd % 32 == 0) { /* load16's e4m3 took 12 instructions per 16 */
        pv_tile_fp8(p, k0, nk, v_cache, slots, slot_stride, h_off, blocks, block_size, dtype, o,
                    rows, hd);
        return;
    }
#endif
    for (int s = 0; s < nk; ++s) {
        prefetch_rows(v_cache, blocks, block_size, k0 + s + PREFETCH_AHEAD, k0 + nk, slot_stride,
                      h_off, hd, elem_size(dtype));
        const int64_t off = slots[s] * slot_stride + h_off;
        for (int c = 0; c < hd / 16; ++c) {
            const __m512 v = load16(v_cache, off + 16 * c, dtype);
            for (int r = 0; r < rows; ++r)
                out[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[(int64_t)r * nk + s]), v,
                                            out[r][c]);
        }
    }
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < hd / 16; ++c) _mm512_storeu_ps(o + (int64_t)r * hd + 16 * c, out[r][c]);
}
#endif

#endif
