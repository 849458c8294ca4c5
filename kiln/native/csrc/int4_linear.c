/* W4A16 kernels over Kiln's canonical int4 layout (kiln/ir/int4.py), read as stored: two 4-bit
 * values a byte (value 2j in byte j's low nibble, 2j + 1 in its high one), a scale per group of
 * `group` values (float32, bfloat16 or float16: scale codes 0, 1, 2) and a uint8 zero point per
 * group (NULL: 8). w[n, k] = (u - z) * scale.
 *
 * kiln_int4_gemv: a decode step's few rows, the nibbles unpacked in AVX-512 registers (a lookup
 * in the group's 16 dequantized values) and dotted with x in float32.
 * kiln_int4_dequant: rows of the weight into a float32 / bfloat16 tile, for a GEMM (prefill).
 */
#include <stdint.h>
#include <stdlib.h>

#include "dtype.h"
#include "kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define CHUNK 32 /* values one 16-byte load holds */

static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    float f;
    if (exp == 0) { /* zero or subnormal: man * 2^-24, exact in float32 */
        f = (float)man * 5.9604644775390625e-08f;
        uint32_t u;
        memcpy(&u, &f, sizeof u);
        u |= sign;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    const uint32_t u = sign | (exp == 31 ? (0xffu << 23) | (man << 13)
                                         : ((exp + 112u) << 23) | (man << 13));
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float load_scale(const void *s, int64_t i, int code) {
    if (code == 0) return ((const float *)s)[i];
    const uint16_t h = ((const uint16_t *)s)[i];
    return code == 1 ? bf16_to_f32(h) : f16_to_f32(h);
}

int kiln_int4_simd(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* Rows of x up to which the GEMV, in passes of KILN_INT4_GEMV_MAX_ROWS rows (each reading the
 * packed weight once more), beats dequantizing the whole weight for one GEMM (docs/measurements.md:
 * a float32 tile is twice a bfloat16 one's bytes and its GEMM gains little from few rows). */
int64_t kiln_int4_gemv_row_limit(int32_t dtype) { return dtype == KILN_F32 ? 32 : 12; }

/* The GEMV reads groups of whole 16-byte chunks; dequantization any even group size. */
static int shapes_ok(int64_t n, int64_t k, int64_t group, int64_t multiple) {
    return n >= 0 && k > 0 && group > 0 && k % group == 0 && group % multiple == 0;
}

/* x [m, k] -> float32 in the chunks' order: per 32 values the 16 at even k, then the 16 at odd
 * k (the low and high nibbles of a chunk's 16 bytes). */
static void prepare_x(const void *x, int dtype, int32_t m, int64_t k, float *xs) {
    for (int32_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < k; c += CHUNK)
            for (int j = 0; j < CHUNK / 2; ++j) {
                xs[r * k + c + j] = load_elem(x, r * k + c + 2 * j, dtype);
                xs[r * k + c + CHUNK / 2 + j] = load_elem(x, r * k + c + 2 * j + 1, dtype);
            }
}

#if defined(__AVX512F__)
/* The group's 16 possible weights, (u - z) * s for u = 0..15, as a register that VPERMPS indexes
 * by a nibble (it reads an index's low 4 bits only, so the low nibble needs no mask): each
 * weight exactly as the reference dequantizes it, for one lookup instead of a conversion. */
static inline __m512 group_table(float s, float z) {
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    return _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(z)), _mm512_set1_ps(s));
}
#endif

/* acc[r] = the row's weights dotted with x row r, M rows at once. */
static inline __attribute__((always_inline)) void row_dots(
    const uint8_t *wr, const void *scales, int s_code, const uint8_t *zr, int64_t srow,
    const float *xs, int64_t k, int64_t group, const int M, float *acc) {
    const int64_t groups = k / group;
#if defined(__AVX512F__)
    __m512 total[8];
    for (int r = 0; r < M; ++r) total[r] = _mm512_setzero_ps();
#endif
    for (int64_t g = 0; g < groups; ++g) {
        const float s = load_scale(scales, srow + g, s_code);
        const float z = zr ? (float)zr[g] : 8.f;
#if defined(__AVX512F__)
        const __m512 table = group_table(s, z);
        for (int64_t c = g * group; c < (g + 1) * group; c += CHUNK) {
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wr + c / 2)));
            const __m512 lo = _mm512_permutexvar_ps(b, table);
            const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
            for (int r = 0; r < M; ++r) {
                total[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xs + r * k + c), total[r]);
                total[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xs + r * k + c + 16), total[r]);
            }
        }
#else
        for (int r = 0; r < M; ++r)
            for (int64_t c = g * group; c < (g + 1) * group; c += CHUNK)
                for (int j = 0; j < CHUNK / 2; ++j) {
                    const uint8_t b = wr[c / 2 + j];
                    acc[r] += ((float)(b & 15) - z) * s * xs[r * k + c + j] +
                              ((float)(b >> 4) - z) * s * xs[r * k + c + CHUNK / 2 + j];
                }
#endif
    }
#if defined(__AVX512F__)
    for (int r = 0; r < M; ++r) acc[r] = _mm512_reduce_add_ps(total[r]);
#endif
}

#define GEMV_CASE(M)                                                                         \
    case M:                                                                                  \
        row_dots(w + o * (k / 2), scales, s_code, zr, o * groups, xs, k, group, M, acc); \
        break;

int kiln_int4_gemv(const void *x, const uint8_t *w, const void *scales, int32_t s_code,
                   const uint8_t *zeros, const void *bias, void *out, int32_t m, int64_t n,
                   int64_t k, int64_t group, int32_t dtype, int32_t num_threads) {
    if (m < 1 || m > KILN_INT4_GEMV_MAX_ROWS || !shapes_ok(n, k, group, CHUNK)) return 1;
    const int64_t groups = k / group;
    float *xs = (float *)malloc(sizeof(float) * (size_t)(m * k));
    if (!xs) return 2;
    prepare_x(x, dtype, m, k, xs);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t o = 0; o < n; ++o) {
        float acc[8] = {0};
        const uint8_t *zr = zeros ? zeros + o * groups : NULL;
        switch (m) {
            GEMV_CASE(1) GEMV_CASE(2) GEMV_CASE(3) GEMV_CASE(4)
            GEMV_CASE(5) GEMV_CASE(6) GEMV_CASE(7) GEMV_CASE(8)
        }
        const float b = bias ? load_elem(bias, o, dtype) : 0.f;
        for (int r = 0; r < m; ++r) store_elem(out, r * n + o, acc[r] + b, dtype);
    }
    free(xs);
    return 0;
}

#if defined(__AVX512F__)
/* One group's values into dst (float32, or bfloat16 where AVX512-BF16 rounds them as torch
 * does), 32 at a time in k order; 0 where it left them to the scalar loop (bfloat16 without
 * AVX512-BF16, or a subnormal value). */
static inline int dequant_group_avx512(const uint8_t *wg, float s, float z, int64_t group,
                                       void *dst, int dtype) {
#if !defined(__AVX512BF16__)
    if (dtype != KILN_F32) return 0;
#endif
    /* lo holds the chunk's even k, hi its odd k: interleave them back into k order */
    const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i second = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                            24, 8);
    const __m512 table = group_table(s, z);
    for (int64_t c = 0; c < group; c += CHUNK) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wg + c / 2)));
        const __m512 lo = _mm512_permutexvar_ps(b, table);
        const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
        const __m512 a = _mm512_permutex2var_ps(lo, first, hi);
        const __m512 bb = _mm512_permutex2var_ps(lo, second, hi);
        if (dtype == KILN_F32) {
            _mm512_storeu_ps((float *)dst + c, a);
            _mm512_storeu_ps((float *)dst + c + 16, bb);
        } else {
#if defined(__AVX512BF16__)
            if (!store_bf16x32((uint16_t *)dst + c, a, bb)) return 0;
#endif
        }
    }
    return 1;
}
#endif

/* out [rows, k] (dtype) = the weight's rows row0 .. row0 + rows, exactly (u - z) * s in float32,
 * rounded to dtype on store as torch's .to(dtype) does. */
int kiln_int4_dequant(const uint8_t *w, const void *scales, int32_t s_code, const uint8_t *zeros,
                      int64_t row0, int64_t rows, int64_t k, int64_t group, void *out,
                      int32_t dtype, int32_t num_threads) {
    if (!shapes_ok(rows, k, group, 2)) return 1;
    const int64_t groups = k / group;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
        const int64_t o = row0 + i;
        const uint8_t *wr = w + o * (k / 2);
        for (int64_t g = 0; g < groups; ++g) {
            const float s = load_scale(scales, o * groups + g, s_code);
            const float z = zeros ? (float)zeros[o * groups + g] : 8.f;
#if defined(__AVX512F__)
            if (group % CHUNK == 0 && dequant_group_avx512(wr + g * group / 2, s, z, group,
                                     (char *)out + (i * k + g * group) * (dtype == KILN_F32 ? 4 : 2),
                                     dtype))
                continue;
#endif
            if (dtype == KILN_F32) {
                float *dst = (float *)out + i * k + g * group;
#pragma omp simd
                for (int64_t j = 0; j < group / 2; ++j) {
                    const uint8_t b = wr[g * group / 2 + j];
                    dst[2 * j] = ((float)(b & 15) - z) * s;
                    dst[2 * j + 1] = ((float)(b >> 4) - z) * s;
                }
            } else {
                uint16_t *dst = (uint16_t *)out + i * k + g * group;
#pragma omp simd
                for (int64_t j = 0; j < group / 2; ++j) {
                    const uint8_t b = wr[g * group / 2 + j];
                    dst[2 * j] = f32_to_bf16(((float)(b & 15) - z) * s);
                    dst[2 * j + 1] = f32_to_bf16(((float)(b >> 4) - z) * s);
                }
            }
        }
    }
    return 0;
}
