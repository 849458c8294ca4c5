/* One bfloat16 row of dynamic_int8_quant(rms_norm(x (+ residual))) in one pass over the normed
 * values for int8_ops.c: the same values, scale and q as the norm kernel then the quant kernel
 * give (rms_norm_rows.h's passes, int8_quant_row.h's arithmetic), bit for bit. */
#ifndef KILN_INT8_NORM_QUANT_ROW_H
#define KILN_INT8_NORM_QUANT_ROW_H

#include <stdint.h>
#include <string.h>

#include "int8_quant_row.h"
#include "int8_simd.h"
#include "rms_norm_rows.h"

#if KILN_INT8_SIMD && KILN_NORM_ROWS_AVX512
#define KILN_INT8_NORM_QUANT_ROW 1

/* The row's normed values stay float32 in buf (in the bfloat16 block order: even values, then
 * odd) with their absmax taken on the way, and are quantized from there: the two-step route
 * wrote them as bfloat16 and read them twice more (absmax, quant), 0.59 against 0.47 ms for 2048
 * rows of 576 on one Zen 4 thread. buf: hidden rounded up to KILN_BLOCK floats, 64-byte aligned;
 * row: as many bfloat16, where a row whose scale is not finite goes to quant_row. */
static inline void rms_norm_int8_quant_row(const void *x, const void *residual,
                                           void *residual_out, const void *weight, int8_t *q,
                                           float *scale, float *buf, uint16_t *row, int hidden,
                                           float eps) {
    const int dtype = KILN_BF16;
    const __mmask32 full = block_mask(KILN_BLOCK), last = block_mask(hidden % KILN_BLOCK);
    const int whole = hidden - hidden % KILN_BLOCK;
    const __m512 inv = rms_norm_inv(x, residual, residual_out, buf, hidden, eps, dtype);
    /* rms_norm_out_block's values, rounded as its store rounds them; the masked lanes hold 0
     * (or NaN where inv is: a row holding a NaN, whose absmax is NaN anyway) */
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
    __m512i amax = _mm512_setzero_si512();
    for (int i = 0; i < hidden; i += KILN_BLOCK) {
        const f32x32 w = load_block(weight, i, dtype, i < whole ? full : last);
        const __m512 a = round_lanes(_mm512_mul_round_ps(_mm512_load_ps(buf + i), inv, KILN_RNE),
                                     dtype);
        const __m512 b = round_lanes(
            _mm512_mul_round_ps(_mm512_load_ps(buf + i + 16), inv, KILN_RNE), dtype);
        const __m512 oa = round_lanes(_mm512_mul_round_ps(a, w.a, KILN_RNE), dtype);
        const __m512 ob = round_lanes(_mm512_mul_round_ps(b, w.b, KILN_RNE), dtype);
        _mm512_store_ps(buf + i, oa);
        _mm512_store_ps(buf + i + 16, ob);
        /* magnitude bits order as the magnitudes (NaN's above inf's), as bf16_abs_max_bits' */
        amax = _mm512_max_epu32(amax, _mm512_and_si512(_mm512_castps_si512(oa), magnitude));
        amax = _mm512_max_epu32(amax, _mm512_and_si512(_mm512_castps_si512(ob), magnitude));
    }
    const uint32_t bits = _mm512_reduce_max_epu32(amax);
    float amax_f;
    memcpy(&amax_f, &bits, sizeof amax_f);
    const __m128 a = _mm_set_ss(amax_f), c = _mm_set_ss(127.f);
    const float inv_q = amax_f > 0.f ? _mm_cvtss_f32(_mm_div_round_ss(c, a, RNE)) : 0.f;
    if (bits > 0x7f800000u || !finite_bits(inv_q) || !finite_bits(amax_f)) {
        /* NaN, inf, or 127 / amax overflowing: quant_row's own handling, on the very row the
         * norm kernel writes */
        for (int i = 0; i < hidden; i += KILN_BLOCK) {
            const f32x32 o = {_mm512_load_ps(buf + i), _mm512_load_ps(buf + i + 16)};
            store_block(row, i, o, dtype, i < whole ? full : last, 1);
        }
        quant_row(row, hidden, dtype, q, scale);
        return;
    }
    *scale = _mm_cvtss_f32(_mm_div_round_ss(a, c, RNE));
    const __m512 vinv = _mm512_set1_ps(inv_q);
    const __m512i low_byte = _mm512_set1_epi32(0xff);
    for (int i = 0; i < hidden; i += KILN_BLOCK) {
        /* |x| <= amax, so |x * inv_q| <= 127 (1 + 2^-24)^2 and rounds to at most 127: the
         * bytes need no saturation (quant_row's saturating packs never saturate either) */
        const __m512i even = _mm512_cvt_roundps_epi32(
            _mm512_mul_round_ps(_mm512_load_ps(buf + i), vinv, RNE), RNE);
        const __m512i odd = _mm512_cvt_roundps_epi32(
            _mm512_mul_round_ps(_mm512_load_ps(buf + i + 16), vinv, RNE), RNE);
        /* lane t: value 2t's byte, value 2t + 1's above it; their 16 bits are q[i + 2t:][:2] */
        const __m512i pairs =
            _mm512_ternarylogic_epi32(low_byte, even, _mm512_slli_epi32(odd, 8), 0xCA);
        _mm256_mask_storeu_epi8(q + i, i < whole ? full : last, _mm512_cvtepi32_epi16(pairs));
    }
}

#else
#define KILN_INT8_NORM_QUANT_ROW 0
#endif

#endif
