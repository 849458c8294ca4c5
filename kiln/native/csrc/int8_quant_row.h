/* One row's symmetric per-token int8 quantization for int8_ops.c's quant kernels: scale =
 * absmax / 127, q = round(x * (127 / absmax)), as kiln/ir/quant.py's reference, bit for bit. */
#ifndef KILN_INT8_QUANT_ROW_H
#define KILN_INT8_QUANT_ROW_H

#include <stdint.h>
#include <string.h>

#include "bf16_simd.h"
#include "int8_simd.h"

#if KILN_INT8_SIMD

/* From the bits: -ffast-math lets the compiler assume every float finite (isfinite: true). */
static inline int finite_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (u & 0x7f800000u) != 0x7f800000u;
}

/* max |x[0:k]| of bfloat16 values as float32 bits. A value's magnitude bits order as the
 * magnitudes do (NaN's above inf's 0x7f80), so one integer max takes 32 values, unconverted. */
static inline uint32_t bf16_abs_max_bits(const uint16_t *x, int64_t k) {
    const __m512i mag = _mm512_set1_epi16(0x7fff);
    __m512i m0 = _mm512_setzero_si512(), m1 = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {
        m0 = _mm512_max_epu16(m0, _mm512_and_si512(_mm512_loadu_si512(x + i), mag));
        m1 = _mm512_max_epu16(m1, _mm512_and_si512(_mm512_loadu_si512(x + i + 32), mag));
    }
    for (; i < k; i += 32) {
        const __mmask32 t = k - i >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (k - i)) - 1);
        m0 = _mm512_max_epu16(m0, _mm512_and_si512(_mm512_maskz_loadu_epi16(t, x + i), mag));
    }
    m0 = _mm512_max_epu16(m0, m1);
    const __m512i w = _mm512_max_epu32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(m0)),
                                       _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(m0, 1)));
    return (uint32_t)_mm512_reduce_max_epu32(w) << 16;
}

/* round(x[i:i+16] * inv) in int32 for 16 bfloat16 values (a finite row). */
static inline __m512i bf16_q16(const uint16_t *x, __m512 vinv) {
    const __m512 v = bf16x16_f32(_mm256_loadu_si256((const __m256i *)x));
    const __m512 p = _mm512_mul_round_ps(v, vinv, RNE);
    return _mm512_cvt_roundps_epi32(p, RNE);
}

/* One row x[0:k] -> q[0:k] = round(x * (127 / amax)) and *scale = amax / 127. */
static void quant_row(const void *x, int64_t k, int dtype, int8_t *q, float *scale) {
    float amax_f;
    int nan;
    if (dtype == KILN_F32) {
        __m512 amax = _mm512_setzero_ps();
        __mmask16 unord = 0;
        for (int64_t i = 0; i < k; i += 16) {
            const __m512 v = load16(x, i, dtype, tail16(k - i));
            unord |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            amax = _mm512_max_ps(amax, _mm512_abs_ps(v)); /* max_ps drops NaN: counted apart */
        }
        nan = unord != 0;
        amax_f = _mm512_reduce_max_ps(amax);
    } else {
        const uint32_t bits = bf16_abs_max_bits((const uint16_t *)x, k);
        nan = bits > 0x7f800000u;
        memcpy(&amax_f, &bits, sizeof amax_f);
    }
    if (nan) {
        /* as the reference: amax NaN, so scale NaN and every q 0 */
        *scale = __builtin_nanf("");
        memset(q, 0, (size_t)k);
        return;
    }
    const __m128 a = _mm_set_ss(amax_f), c = _mm_set_ss(127.f);
    *scale = _mm_cvtss_f32(_mm_div_round_ss(a, c, RNE));
    const float inv = amax_f > 0.f ? _mm_cvtss_f32(_mm_div_round_ss(c, a, RNE)) : 0.f;
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512 lo = _mm512_set1_ps(-128.f), hi = _mm512_set1_ps(127.f);
    /* x * inv is non-finite only where 127 / amax overflowed (a row of tiny values) or amax is
     * inf: there 0 * inf is 0 and +-inf saturates, as the reference says (the conversion alone
     * gave -128 for all three). Other rows skip the check. */
    const int finite = finite_bits(inv) && finite_bits(amax_f);
    int64_t i = 0;
    if (finite && dtype != KILN_F32) {
        /* 64 values a step: two saturating packs (int32 -> int16 -> int8, as VPMOVSDB saturates)
         * leave each 128-bit lane's four dwords from a, b, c, d in turn; a dword permute puts
         * them back in order, and one store writes them */
        const __m512i order =
            _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        const uint16_t *xb = (const uint16_t *)x;
        for (; i + 64 <= k; i += 64) {
            const __m512i ab = _mm512_packs_epi32(bf16_q16(xb + i, vinv),
                                                  bf16_q16(xb + i + 16, vinv));
            const __m512i cd = _mm512_packs_epi32(bf16_q16(xb + i + 32, vinv),
                                                  bf16_q16(xb + i + 48, vinv));
            _mm512_storeu_si512(q + i, _mm512_permutexvar_epi32(order, _mm512_packs_epi16(ab, cd)));
        }
    }
    for (; i < k; i += 16) {
        const __mmask16 m = tail16(k - i);
        __m512 p = _mm512_mul_round_ps(load16(x, i, dtype, m), vinv, RNE);
        if (!finite) {
            p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(p, p, _CMP_ORD_Q), p);
            p = _mm512_min_ps(_mm512_max_ps(p, lo), hi);
        }
        _mm512_mask_cvtsepi32_storeu_epi8(q + i, m, _mm512_cvt_roundps_epi32(p, RNE));
    }
}

#endif
#endif
