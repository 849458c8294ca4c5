/* The decode kernel's p . v on AVX512-BF16 (VDPBF16PS) for bfloat16 queries over a bfloat16 or
 * fp8 cache: the softmax weights rounded to bfloat16, as HF's eager attention and the prefill
 * kernel round them, each instruction two keys' products for 16 dims. */
#ifndef KILN_PAGED_ATTENTION_PV_H
#define KILN_PAGED_ATTENTION_PV_H

#include <stdint.h>

#include "dtype.h"
#include "fp8_simd.h"
#include "paged_attention_rows.h"

#if KILN_ATTN_BF16_DOT
/* A chunk's weights e [16] (lanes past the chunk's keys 0) as bfloat16 into the first 32 bytes of
 * pr (its row of the chunk's scores): keys j, j + 1 share 32 bits, the pair VDPBF16PS multiplies
 * with one word of each value row. Rounded to
 * nearest even, as torch's .to(bfloat16); a NaN stays NaN. Each weight is e^(score - a running
 * maximum), not yet divided by the sum: rounding it relative to its own size, as dividing first
 * and rounding after does (both within 2^-9 of the weight). */
static inline void round_weights(__m512 e, float *pr) {
    _mm256_storeu_si256((__m256i *)pr, (__m256i)_mm512_cvtneps_pbh(e));
}

/* 32 values of a bfloat16 value row, or an fp8 one's converted (exact), at element offset off. */
static inline __attribute__((always_inline)) __m512i v32_bf16(const void *v_cache, int64_t off,
                                                              int dtype, const void *tab) {
#if KILN_FP8_SIMD
    if (dtype != KILN_BF16) return fp8x32_bf16((const uint8_t *)v_cache + off, (const Fp8Tab *)tab);
#endif
    (void)tab, (void)dtype;
    return _mm512_loadu_si512((const uint16_t *)v_cache + off);
}

/* o [rows, w] (row stride hd) = o * alpha[r] (nothing where `first`) + sum over the chunk's n keys
 * of p [rows, CHUNK_KEYS] (each row's weights as round_weights stored them) * value row j's w values at element offset off + j *
 * slot_stride (w a multiple of 32, <= 128). Keys go in pairs: their rows' words interleaved
 * (VPUNPCK{L,H}WD) meet a pair of weights, so each 32 dims of o hold, by 128-bit lane L, dims
 * 8L..8L+3 in the first 16 floats and 8L+4..8L+7 in the second (unpermute_rows restores them). */
static inline __attribute__((always_inline)) void pv_chunk_bf16(
    const float *p, const float *alpha, const void *v_cache, int64_t off, int64_t slot_stride,
    int n, int dtype, const void *tab, float *o, int first, const int rows, const int w,
    const int hd) {
    __m512 out[4][8];
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < w / 16; ++c)
            out[r][c] = first ? _mm512_setzero_ps()
                              : _mm512_mul_ps(_mm512_loadu_ps(o + (int64_t)r * hd + 16 * c),
                                              _mm512_set1_ps(alpha[r]));
    const uint32_t *pairs = (const uint32_t *)p;
    for (int j = 0; j < n; j += 2, off += 2 * slot_stride) {
        __m512bh pp[4];
        for (int r = 0; r < rows; ++r) /* weights j, j + 1 (0 past the chunk) in every lane */
            pp[r] = (__m512bh)_mm512_set1_epi32((int)pairs[r * CHUNK_KEYS + j / 2]);
        for (int c = 0; c < w / 32; ++c) {
            const __m512i a = v32_bf16(v_cache, off + 32 * c, dtype, tab);
            /* an odd chunk's last key pairs with zeros, not a row past the chunk (a NaN there
             * would reach the output through its zero weight) */
            const __m512i b = j + 1 < n ? v32_bf16(v_cache, off + slot_stride + 32 * c, dtype, tab)
                                        : _mm512_setzero_si512();
            const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b);
            const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
            for (int r = 0; r < rows; ++r) {
                out[r][2 * c] = _mm512_dpbf16_ps(out[r][2 * c], lo, pp[r]);
                out[r][2 * c + 1] = _mm512_dpbf16_ps(out[r][2 * c + 1], hi, pp[r]);
            }
        }
    }
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < w / 16; ++c)
            _mm512_storeu_ps(o + (int64_t)r * hd + 16 * c, out[r][c]);
}

/* Each 32 values of the rows of o [rows, hd] from pv_chunk_bf16's order back into dim order. */
static inline void unpermute_rows(float *o, int rows, const int hd) {
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    for (int64_t i = 0; i < (int64_t)rows * hd; i += 32) {
        const __m512 x = _mm512_loadu_ps(o + i), y = _mm512_loadu_ps(o + i + 16);
        _mm512_storeu_ps(o + i, _mm512_permutex2var_ps(x, lo, y));
        _mm512_storeu_ps(o + i + 16, _mm512_permutex2var_ps(x, hi, y));
    }
}
#else
/* never taken: bf16_dot is 0 */
#define round_weights(e, pr) ((void)(e), (void)(pr))
#define pv_chunk_bf16(p, alpha, v, off, ss, n, dtype, tab, o, first, rows, w, hd) ((void)0)
#define unpermute_rows(o, rows, hd) ((void)0)
#endif

#endif
