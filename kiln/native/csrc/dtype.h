/* The element types Kiln's CPU kernels read and write: float32 (0) and bfloat16 (1).
 * Kernels compute in float32 and round on store, as torch's CPU kernels do. */
#ifndef KILN_DTYPE_H
#define KILN_DTYPE_H

#include <stdint.h>
#include <string.h>

enum { KILN_F32 = 0, KILN_BF16 = 1 };

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    /* A select, not a branch, so that loops of conversions vectorize. */
    const uint32_t nan = (uint16_t)((u >> 16) | 0x40u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

static inline float load_elem(const void *base, int64_t i, int dtype) {
    return dtype == KILN_F32 ? ((const float *)base)[i] : bf16_to_f32(((const uint16_t *)base)[i]);
}

static inline void store_elem(void *base, int64_t i, float v, int dtype) {
    if (dtype == KILN_F32)
        ((float *)base)[i] = v;
    else
        ((uint16_t *)base)[i] = f32_to_bf16(v);
}

/* v as the dtype would hold it (what a torch op in that dtype would have produced). */
static inline float round_to(float v, int dtype) {
    return dtype == KILN_F32 ? v : bf16_to_f32(f32_to_bf16(v));
}

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* dst[0:32] = bfloat16 of lo then hi, in one VCVTNE2PS2BF16, which rounds to nearest even as
 * f32_to_bf16 does but flushes subnormals to zero: where a value is subnormal it stores nothing
 * and returns 0, for the caller to round those 32 its own way; else 1. */
static inline int store_bf16x32(uint16_t *dst, __m512 lo, __m512 hi) {
    if (_mm512_fpclass_ps_mask(lo, 0x20) | _mm512_fpclass_ps_mask(hi, 0x20)) return 0;
    _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    return 1;
}
#endif

#endif
