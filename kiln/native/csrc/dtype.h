/* The element types Kiln's CPU kernels read and write: float32 (0) and bfloat16 (1); an fp8 KV
 * cache (--kv-cache-dtype) holds float8_e4m3fn (2) or float8_e5m2 (3), read as float32.
 * Kernels compute in float32 and round on store, as torch's CPU kernels do. */
#ifndef KILN_DTYPE_H
#define KILN_DTYPE_H

#include <stdint.h>
#include <string.h>

enum { KILN_F32 = 0, KILN_BF16 = 1, KILN_FP8E4M3 = 2, KILN_FP8E5M2 = 3 };

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

static inline size_t elem_size(int dtype) { /* bytes of an element */
    return dtype == KILN_F32 ? 4 : dtype == KILN_BF16 ? 2 : 1;
}

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* An fp8 byte as float32 (exact). e4m3fn: bias 7, no infinities (0x7f/0xff NaN); e5m2: bias
 * 15, fp16's top byte. Subnormals as their mantissa times the smallest step. */
static inline float fp8_to_f32(uint8_t x, int dtype) {
    const uint32_t sign = (uint32_t)(x & 0x80) << 24;
    if (dtype == KILN_FP8E4M3) {
        const uint32_t e = (x >> 3) & 15, m = x & 7;
        if (e == 15 && m == 7) return bits_f32(sign | 0x7fc00000u);
        if (e == 0) return (sign ? -1.f : 1.f) * (float)m * 0x1p-9f;
        return bits_f32(sign | (e + 120) << 23 | m << 20);
    }
    const uint32_t e = (x >> 2) & 31, m = x & 3;
    if (e == 31) return bits_f32(sign | (m ? 0x7fc00000u : 0x7f800000u));
    if (e == 0) return (sign ? -1.f : 1.f) * (float)m * 0x1p-16f;
    return bits_f32(sign | (e + 112) << 23 | m << 21);
}

/* float32 to fp8, rounded to nearest even and saturated to the format's largest finite value
 * (448 for e4m3fn, 57344 for e5m2), as vLLM's cache write does; NaN stays NaN. Bit tests, not
 * float compares, for NaN: the library builds with -ffast-math. */
static inline uint8_t f32_to_fp8(float f, int dtype) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    uint32_t a = u & 0x7fffffffu;
    const int e4 = dtype == KILN_FP8E4M3;
    if (a > 0x7f800000u) return sign | 0x7f; /* NaN in both formats */
    const uint32_t max_bits = e4 ? 0x43e00000u : 0x47600000u; /* 448, 57344 */
    if (a >= max_bits) return sign | (e4 ? 0x7e : 0x7b);
    const uint32_t min_normal = e4 ? 0x3c800000u : 0x38800000u; /* 2^-6, 2^-14 */
    if (a < min_normal) { /* subnormal steps: 2^-9, 2^-16 (8 or 4 steps round up to normal) */
        const float steps = bits_f32(a) * (e4 ? 0x1p9f : 0x1p16f);
        uint32_t n = (uint32_t)steps;
        const float frac = steps - (float)n;
        n += frac > 0.5f || (frac == 0.5f && (n & 1));
        return sign | (uint8_t)n;
    }
    const int mbits = e4 ? 3 : 2, drop = 23 - mbits;
    a += (1u << (drop - 1)) - 1 + ((a >> drop) & 1); /* round to nearest even */
    const uint32_t e = (a >> 23) - 127 + (e4 ? 7 : 15), m = (a >> drop) & ((1u << mbits) - 1);
    return sign | (uint8_t)(e << mbits | m);
}

static inline float load_elem(const void *base, int64_t i, int dtype) {
    if (dtype == KILN_F32) return ((const float *)base)[i];
    if (dtype == KILN_BF16) return bf16_to_f32(((const uint16_t *)base)[i]);
    return fp8_to_f32(((const uint8_t *)base)[i], dtype);
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
