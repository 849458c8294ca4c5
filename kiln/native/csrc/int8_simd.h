/* The AVX512 pieces the int8 kernels share (int8_ops.c's VNNI kernels, the panel GEMMs):
 * masked loads and stores of float32 / bfloat16 rows, and the GEMM's epilogue. */
#ifndef KILN_INT8_SIMD_H
#define KILN_INT8_SIMD_H

#include <stddef.h>
#include <stdint.h>

#include "dtype.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define KILN_INT8_SIMD 1
#include <immintrin.h>

#include "bf16_simd.h"

#define RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)


static inline __mmask16 tail16(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

static inline __m512 load16(const void *base, int64_t i, int dtype, __mmask16 m) {
    if (dtype == KILN_F32) return _mm512_maskz_loadu_ps(m, (const float *)base + i);
    return bf16x16_f32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)base + i));
}

static inline void store16(void *base, int64_t i, __m512 v, int dtype, __mmask16 m) {
    if (dtype == KILN_F32) {
        _mm512_mask_storeu_ps((float *)base + i, m, v);
        return;
    }
    _mm256_mask_storeu_epi16((uint16_t *)base + i, m, bf16x16(v));
}

/* float32(sums) * sa * ws (+ b where has_bias), each step rounded as torch's float32 ops round
 * it: the GEMMs' epilogue on 16 sums in a register (the offset already taken off), with the
 * scales (and bias) already in registers (int8_vnni_gemm.c loads a panel's once for all of a
 * register tile's rows). */
static inline __m512 scaled16_of(__m512i sums, __m512 sa, __m512 ws, __m512 b, int has_bias) {
    __m512 f = _mm512_mul_round_ps(_mm512_cvt_roundepi32_ps(sums, RNE), sa, RNE);
    f = _mm512_mul_round_ps(f, ws, RNE);
    if (has_bias) f = _mm512_add_round_ps(f, b, RNE);
    return f;
}

/* scaled16_of(acc - off) with w_scale[j:j+16] (+ bias[j:j+16]) on lanes m. */
static inline __m512 scaled16(__m512i acc, __m512i off, __m512 sa, const float *w_scale,
                              const void *bias, int bias_dtype, int64_t j, __mmask16 m) {
    return scaled16_of(_mm512_sub_epi32(acc, off), sa, _mm512_maskz_loadu_ps(m, w_scale + j),
                       bias ? load16(bias, j, bias_dtype, m) : _mm512_setzero_ps(), bias != NULL);
}

/* out[j:j+16] (lanes m) = dtype(scaled16(...)). */
static inline void scale16(__m512i acc, __m512i off, __m512 sa, const float *w_scale,
                           const void *bias, int bias_dtype, void *out, int64_t j, __mmask16 m,
                           int out_dtype) {
    store16(out, j, scaled16(acc, off, sa, w_scale, bias, bias_dtype, j, m), out_dtype, m);
}

/* out[j:j+32] = f0 then f1 in the dtype: bfloat16 in one instruction where the CPU has
 * AVX512-BF16 (dtype.h's store_bf16x32; store16 takes bf16_simd.h's integer steps). */
static inline void store32(void *out, int64_t j, __m512 f0, __m512 f1, int out_dtype) {
#if defined(__AVX512BF16__)
    if (out_dtype != KILN_F32 && store_bf16x32((uint16_t *)out + j, f0, f1)) return;
#endif
    store16(out, j, f0, out_dtype, 0xffff);
    store16(out, j + 16, f1, out_dtype, 0xffff);
}

/* out[j:j+32] = scale16 of two whole registers of sums. */
static inline void scale32(__m512i acc0, __m512i acc1, __m512i off, __m512 sa,
                           const float *w_scale, const void *bias, int bias_dtype, void *out,
                           int64_t j, int out_dtype) {
    store32(out, j, scaled16(acc0, off, sa, w_scale, bias, bias_dtype, j, 0xffff),
            scaled16(acc1, off, sa, w_scale, bias, bias_dtype, j + 16, 0xffff), out_dtype);
}

/* out[0:n] = scale16 over int32 sums acc[0:n] in memory. */
static inline void scale_row(const int32_t *acc, int32_t off, float a_scale, const float *w_scale,
                             const void *bias, int bias_dtype, void *out, int64_t n, int out_dtype) {
    const __m512 sa = _mm512_set1_ps(a_scale);
    const __m512i voff = _mm512_set1_epi32(off);
    int64_t j = 0;
    for (; j + 32 <= n; j += 32)
        scale32(_mm512_loadu_si512(acc + j), _mm512_loadu_si512(acc + j + 16), voff, sa, w_scale,
                bias, bias_dtype, out, j, out_dtype);
    for (; j < n; j += 16) {
        const __mmask16 m = tail16(n - j);
        scale16(_mm512_maskz_loadu_epi32(m, acc + j), voff, sa, w_scale, bias, bias_dtype, out, j,
                m, out_dtype);
    }
}

/* sum(a[0:k]) in int32: what a GEMM that adds 128 to the weights (VNNI multiplies u8 by s8)
 * takes back, 128 times, per row. */
static inline int32_t row_sum(const int8_t *a, int64_t k) {
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i acc = _mm512_setzero_si512();
    for (int64_t i = 0; i < k; i += 64) {
        const __mmask64 m = k - i >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (k - i)) - 1);
        acc = _mm512_dpbusd_epi32(acc, ones, _mm512_maskz_loadu_epi8(m, a + i));
    }
    return _mm512_reduce_add_epi32(acc);
}

/* 128 x row_sum: the offset a GEMM over weights + 128 takes back, wrapping as the int32 sums
 * it is taken from do (no signed overflow at large k). */
static inline int32_t row_offset(const int8_t *a, int64_t k) {
    return (int32_t)((uint32_t)row_sum(a, k) << 7);
}

#else
#define KILN_INT8_SIMD 0
#endif

#endif
