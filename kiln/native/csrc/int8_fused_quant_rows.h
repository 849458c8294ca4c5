/* The bfloat16 rows of the fused quant ops (int8_ops.c) in one pass over their values:
 * dynamic_int8_quant(rms_norm(x (+ residual))) and dynamic_int8_quant(silu_and_mul(x)), the same
 * values, scale and q as the unfused kernel then the quant kernel give (row_blocks.h's passes,
 * int8_quant_row.h's arithmetic), bit for bit. */
#ifndef KILN_INT8_FUSED_QUANT_ROWS_H
#define KILN_INT8_FUSED_QUANT_ROWS_H

#include <stdint.h>
#include <string.h>

#include "int8_quant_row.h"
#include "int8_simd.h"
#include "row_blocks.h"

#if KILN_INT8_SIMD && KILN_ROW_BLOCKS_AVX512
#define KILN_INT8_FUSED_QUANT_ROWS 1

/* The row's values stay float32 in buf (each block of 32 in the bfloat16 block order: even
 * values, then odd), rounded as the unfused kernel's store rounds them, with their absmax taken
 * on the way, and are quantized from there: the unfused route wrote them as bfloat16 and read
 * them twice more (absmax, quant), through a kernel call per chunk of rows. */

/* A block's two halves as their store to bfloat16 rounds them, into buf at i; the running
 * maximum of their magnitude bits (which order as the magnitudes do, NaN's above inf's, as
 * bf16_abs_max_bits' do). Masked lanes hold 0 (or NaN where the row's norm is NaN, whose
 * absmax is NaN all the same). */
KILN_INLINE void keep_block(float *buf, int64_t i, f32x32 v, __m512i *amax) {
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
    const __m512 a = round_lanes(v.a, KILN_BF16), b = round_lanes(v.b, KILN_BF16);
    _mm512_store_ps(buf + i, a);
    _mm512_store_ps(buf + i + 16, b);
    *amax = _mm512_max_epu32(*amax, _mm512_and_si512(_mm512_castps_si512(a), magnitude));
    *amax = _mm512_max_epu32(*amax, _mm512_and_si512(_mm512_castps_si512(b), magnitude));
}

/* q[0:n], *scale from the n values keep_block left in buf and their absmax: quant_row's. A row
 * whose absmax is NaN or inf, or whose 127 / absmax overflows, goes to quant_row itself, written
 * out as bfloat16 into row (n rounded up to KILN_BLOCK values). */
KILN_INLINE void quant_kept(const float *buf, __m512i amax, int n, int8_t *q, float *scale,
                            uint16_t *row) {
    const __mmask32 full = block_mask(KILN_BLOCK), last = block_mask(n % KILN_BLOCK);
    const int whole = n - n % KILN_BLOCK;
    const uint32_t bits = _mm512_reduce_max_epu32(amax);
    float amax_f;
    memcpy(&amax_f, &bits, sizeof amax_f);
    const __m128 a = _mm_set_ss(amax_f), c = _mm_set_ss(127.f);
    const float inv = amax_f > 0.f ? _mm_cvtss_f32(_mm_div_round_ss(c, a, RNE)) : 0.f;
    if (bits > 0x7f800000u || !finite_bits(inv) || !finite_bits(amax_f)) {
        for (int i = 0; i < n; i += KILN_BLOCK) {
            const f32x32 v = {_mm512_load_ps(buf + i), _mm512_load_ps(buf + i + 16)};
            store_block(row, i, v, KILN_BF16, i < whole ? full : last, 1);
        }
        quant_row(row, n, KILN_BF16, q, scale);
        return;
    }
    *scale = _mm_cvtss_f32(_mm_div_round_ss(a, c, RNE));
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i low_byte = _mm512_set1_epi32(0xff);
    for (int i = 0; i < n; i += KILN_BLOCK) {
        /* |x| <= amax, so |x * inv| <= 127 (1 + 2^-24)^2 and rounds to at most 127: the bytes
         * need no saturation (quant_row's saturating packs never saturate either) */
        const __m512i even = _mm512_cvt_roundps_epi32(
            _mm512_mul_round_ps(_mm512_load_ps(buf + i), vinv, RNE), RNE);
        const __m512i odd = _mm512_cvt_roundps_epi32(
            _mm512_mul_round_ps(_mm512_load_ps(buf + i + 16), vinv, RNE), RNE);
        /* lane t: value 2t's byte, value 2t + 1's above it, the two bytes q[i + 2t:][:2] */
        const __m512i pairs =
            _mm512_ternarylogic_epi32(low_byte, even, _mm512_slli_epi32(odd, 8), 0xCA);
        _mm256_mask_storeu_epi8(q + i, i < whole ? full : last, _mm512_cvtepi32_epi16(pairs));
    }
}

/* One row of dynamic_int8_quant(rms_norm(x (+ residual))) (kiln_rms_norm's arguments). buf:
 * hidden rounded up to KILN_BLOCK floats, 64-byte aligned; row: as many bfloat16. */
static inline void rms_norm_int8_quant_row(const void *x, const void *residual,
                                           void *residual_out, const void *weight, int8_t *q,
                                           float *scale, float *buf, uint16_t *row, int hidden,
                                           float eps) {
    const __mmask32 full = block_mask(KILN_BLOCK), last = block_mask(hidden % KILN_BLOCK);
    const int whole = hidden - hidden % KILN_BLOCK;
    const __m512 inv = rms_norm_inv(x, residual, residual_out, buf, hidden, eps, KILN_BF16);
    __m512i amax = _mm512_setzero_si512();
    for (int i = 0; i < hidden; i += KILN_BLOCK)
        keep_block(buf, i, rms_norm_values(weight, buf, i, inv, KILN_BF16,
                                           i < whole ? full : last), &amax);
    quant_kept(buf, amax, hidden, q, scale, row);
}

/* One row of dynamic_int8_quant(silu_and_mul(x = [gate | up])), d values. buf and row as
 * rms_norm_int8_quant_row's, for d. */
static inline void silu_and_mul_int8_quant_row(const void *x, int d, int8_t *q, float *scale,
                                               float *buf, uint16_t *row) {
    const __mmask32 full = block_mask(KILN_BLOCK), last = block_mask(d % KILN_BLOCK);
    const int whole = d - d % KILN_BLOCK;
    __m512i amax = _mm512_setzero_si512();
    for (int i = 0; i < d; i += KILN_BLOCK)
        keep_block(buf, i, silu_and_mul_values(x, d, i, KILN_BF16, i < whole ? full : last),
                   &amax);
    quant_kept(buf, amax, d, q, scale, row);
}

#else
#define KILN_INT8_FUSED_QUANT_ROWS 0
#endif

#endif
