/* RMSNorm's and SiLU-and-mul's row passes on AVX-512, in blocks of 32 values, for layer_ops.c's
 * kernels and int8_fused_quant_rows.h's bfloat16 rows of them with the int8 quant in one pass,
 * so that both compute every value the same way. */
#ifndef KILN_ROW_BLOCKS_H
#define KILN_ROW_BLOCKS_H

#include <stdint.h>

#include "dtype.h"

#define KILN_INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define KILN_ROW_BLOCKS_AVX512 1
/* AVX-512: blocks of 32 values in two registers, the last block masked. A bfloat16 block is one
 * 64-byte load split into its even and odd values (bf16_simd.h's bf16_even / bf16_odd) and
 * joined back the same way on store; float32's is two loads. The float steps use the explicitly
 * rounded intrinsics (_round_ps): the library builds with -ffast-math, under which GCC could
 * reassociate plain vector arithmetic or turn a division into a reciprocal estimate, and each
 * step must round as the torch op it stands for does. */
#include <immintrin.h>

#include "bf16_simd.h"
#include "simd_exp.h"

#define KILN_RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define KILN_BLOCK 32

/* 32 values: bfloat16's even (a) and odd (b) ones, float32's first (a) and last (b) 16. */
typedef struct {
    __m512 a, b;
} f32x32;

/* The lanes of a block of 32 with `left` values still to go (none where left <= 0). */
KILN_INLINE __mmask32 block_mask(int left) {
    return left <= 0           ? (__mmask32)0
           : left >= KILN_BLOCK ? (__mmask32)0xffffffffu
                                : (__mmask32)((1u << left) - 1);
}

KILN_INLINE f32x32 load_block(const void *base, int64_t i, int dtype, __mmask32 m) {
    f32x32 v;
    if (dtype == KILN_F32) {
        v.a = _mm512_maskz_loadu_ps((__mmask16)m, (const float *)base + i);
        v.b = _mm512_maskz_loadu_ps((__mmask16)(m >> 16), (const float *)base + i + 16);
    } else {
        const __m512i w = _mm512_maskz_loadu_epi16(m, (const uint16_t *)base + i);
        v.a = bf16_even(w);
        v.b = bf16_odd(w);
    }
    return v;
}

/* v as the dtype holds it (round_to). */
KILN_INLINE __m512 round_lanes(__m512 v, int dtype) {
    if (dtype == KILN_F32) return v;
    return bf16_round(v);
}

/* Stores v, rounding it to the dtype unless `exact` (its values already are bfloat16's). */
KILN_INLINE void store_block(void *base, int64_t i, f32x32 v, int dtype, __mmask32 m, int exact) {
    if (dtype == KILN_F32) {
        _mm512_mask_storeu_ps((float *)base + i, (__mmask16)m, v.a);
        _mm512_mask_storeu_ps((float *)base + i + 16, (__mmask16)(m >> 16), v.b);
        return;
    }
    const __m512i a = exact ? _mm512_castps_si512(v.a) : bf16_top(v.a);
    const __m512i b = exact ? _mm512_castps_si512(v.b) : bf16_top(v.b);
    _mm512_mask_storeu_epi16((uint16_t *)base + i, m, bf16_join(a, b));
}

/* One block of a row's first pass: the values (with the residual added, rounded, and written
 * to residual_out) into buf, their squares into the sums. */
KILN_INLINE void rms_norm_sum_block(const void *x, const void *residual, void *residual_out,
                                    float *buf, int64_t i, __m512 *sq_a, __m512 *sq_b, int dtype,
                                    __mmask32 m) {
    f32x32 v = load_block(x, i, dtype, m);
    if (residual) {
        const f32x32 r = load_block(residual, i, dtype, m);
        v.a = round_lanes(_mm512_add_round_ps(v.a, r.a, KILN_RNE), dtype);
        v.b = round_lanes(_mm512_add_round_ps(v.b, r.b, KILN_RNE), dtype);
        /* residual_out may be residual: this block of it is read */
        if (residual_out) store_block(residual_out, i, v, dtype, m, 1);
    }
    _mm512_store_ps(buf + i, v.a);
    _mm512_store_ps(buf + i + 16, v.b);
    *sq_a = _mm512_fmadd_round_ps(v.a, v.a, *sq_a, KILN_RNE);
    *sq_b = _mm512_fmadd_round_ps(v.b, v.b, *sq_b, KILN_RNE);
}

/* weight * dtype(x * inv) of the block at i of a row's values in buf, before its rounding to
 * the dtype (store_block's). */
KILN_INLINE f32x32 rms_norm_values(const void *weight, const float *buf, int64_t i, __m512 inv,
                                   int dtype, __mmask32 m) {
    const f32x32 w = load_block(weight, i, dtype, m);
    f32x32 o;
    o.a = round_lanes(_mm512_mul_round_ps(_mm512_load_ps(buf + i), inv, KILN_RNE), dtype);
    o.b = round_lanes(_mm512_mul_round_ps(_mm512_load_ps(buf + i + 16), inv, KILN_RNE), dtype);
    o.a = _mm512_mul_round_ps(o.a, w.a, KILN_RNE);
    o.b = _mm512_mul_round_ps(o.b, w.b, KILN_RNE);
    return o;
}

KILN_INLINE void rms_norm_out_block(const void *weight, void *out, const float *buf, int64_t i,
                                    __m512 inv, int dtype, __mmask32 m) {
    store_block(out, i, rms_norm_values(weight, buf, i, inv, dtype, m), dtype, m, 0);
}

/* A row's first pass (see kiln_rms_norm): its values (with the residual added, written to
 * residual_out) into buf (64-byte aligned, hidden rounded up to KILN_BLOCK), full blocks then the
 * last one masked (its missing lanes 0); returns rsqrt(mean(x^2) + eps) in every lane. */
KILN_INLINE __m512 rms_norm_inv(const void *x, const void *residual, void *residual_out,
                                float *buf, int hidden, float eps, int dtype) {
    const __mmask32 full = block_mask(KILN_BLOCK), last = block_mask(hidden % KILN_BLOCK);
    const int whole = hidden - hidden % KILN_BLOCK;
    __m512 sq_a = _mm512_setzero_ps(), sq_b = _mm512_setzero_ps();
    for (int i = 0; i < whole; i += KILN_BLOCK)
        rms_norm_sum_block(x, residual, residual_out, buf, i, &sq_a, &sq_b, dtype, full);
    if (whole < hidden)
        rms_norm_sum_block(x, residual, residual_out, buf, whole, &sq_a, &sq_b, dtype, last);
    const float sq = _mm512_reduce_add_ps(_mm512_add_round_ps(sq_a, sq_b, KILN_RNE));
    /* rsqrt(mean + eps) step by step: under -ffast-math a plain 1 / sqrtf becomes an rsqrt
     * estimate and a Newton step, 1-2 ulp off and NaN (0 * inf) where the squares overflow and
     * torch's is 0 */
    const __m128 var = _mm_add_round_ss(
        _mm_div_round_ss(_mm_set_ss(sq), _mm_set_ss((float)hidden), KILN_RNE), _mm_set_ss(eps),
        KILN_RNE);
    return _mm512_set1_ps(_mm_cvtss_f32(
        _mm_div_round_ss(_mm_set_ss(1.f), _mm_sqrt_round_ss(var, var, KILN_RNE), KILN_RNE)));
}

/* One row: see kiln_rms_norm. buf as rms_norm_inv's. */
KILN_INLINE void rms_norm_row(const void *x, const void *residual, void *residual_out,
                              const void *weight, void *out, float *buf, int hidden, float eps,
                              int dtype) {
    const __mmask32 full = block_mask(KILN_BLOCK), last = block_mask(hidden % KILN_BLOCK);
    const int whole = hidden - hidden % KILN_BLOCK;
    const __m512 inv = rms_norm_inv(x, residual, residual_out, buf, hidden, eps, dtype);
    for (int i = 0; i < whole; i += KILN_BLOCK)
        rms_norm_out_block(weight, out, buf, i, inv, dtype, full);
    if (whole < hidden) rms_norm_out_block(weight, out, buf, whole, inv, dtype, last);
}

/* dtype(silu(g)) = dtype(g / (1 + e^-g)), the division exact as torch's; a masked-off lane
 * holds 0 (e^0 = 1). */
KILN_INLINE __m512 silu_lanes(__m512 g, int dtype) {
    const __m512 e = kiln_exp512(_mm512_sub_round_ps(_mm512_setzero_ps(), g, KILN_RNE));
    const __m512 s = _mm512_div_round_ps(
        g, _mm512_add_round_ps(_mm512_set1_ps(1.f), e, KILN_RNE), KILN_RNE);
    return round_lanes(s, dtype);
}

/* dtype(silu(gate)) * up of the block at i of a row x = [gate | up] (d each), before its
 * rounding to the dtype (store_block's). */
KILN_INLINE f32x32 silu_and_mul_values(const void *x, int d, int64_t i, int dtype, __mmask32 m) {
    const f32x32 g = load_block(x, i, dtype, m);
    f32x32 o;
    o.a = silu_lanes(g.a, dtype);
    o.b = silu_lanes(g.b, dtype);
    const f32x32 u = load_block(x, (int64_t)d + i, dtype, m);
    o.a = _mm512_mul_round_ps(o.a, u.a, KILN_RNE);
    o.b = _mm512_mul_round_ps(o.b, u.b, KILN_RNE);
    return o;
}

KILN_INLINE void silu_and_mul_block(const void *x, void *out, int d, int64_t i, int dtype,
                                    __mmask32 m) {
    store_block(out, i, silu_and_mul_values(x, d, i, dtype, m), dtype, m, 0);
}

#else
#define KILN_ROW_BLOCKS_AVX512 0
#endif

#endif
