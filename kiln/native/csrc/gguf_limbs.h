/* x cut into int8 limbs for gguf_int_dot.h's integer dot products, and the dot product itself.
 *
 * Each 32 values of a row of x become `limbs` int8 vectors with a power-of-two scale 2^e chosen
 * so |x| / 2^e < 64: x = 2^e (h + l1 / 128 + l2 / 128^2), h and each l in [-64, 64], every limb
 * rounded to nearest. Three limbs (float32 x) hold x to 2^-20 of the block's largest value: a
 * linear's outputs come within 1-4e-6 of the largest of the exact ones, where a float32 GEMM's
 * come within 3-5e-7. Two limbs (bfloat16 x) hold it to 2^-13, finer than bfloat16 does. The
 * power-of-two scale keeps exact inputs exact: a one-hot x is held as it is. A row of only tiny
 * values (below 2^-32: 1e-30, subnormals) is first scaled up by a power of two, and its outputs
 * back down (`shift`): the blocks' scales would leave float32's range, and zero the row. */
#ifndef KILN_GGUF_LIMBS_H
#define KILN_GGUF_LIMBS_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_simd.h"
#include "dtype.h"
#include "gguf_blocks.h"

#define LIMB_SHIFT 7

/* x [m, k] in limbs; per 32-value block i = row * (k / 32) + block, each array [m * k / 32]. */
typedef struct {
    int8_t *q;      /* [m, k / 32, limbs, 32] */
    float *dx;      /* the unit of the last limb, 2^(e - 7 (limbs - 1)) */
    float *sx;      /* the sum of x as the limbs hold it */
    int32_t *first; /* the sum of the first limb */
    int32_t *rest;  /* the sum of the others, combined as (l1 << 7) + l2 */
    int32_t *half;  /* [.., 2]: x as the limbs hold it, / dx, summed over values 0-15, 16-31 */
    int32_t *shift; /* [m]: the row was held times 2^shift (0 but for rows of tiny values) */
} XLimbs;

/* Room for m rows of k; 0 when out of memory. */
static int xlimbs_alloc(XLimbs *x, int64_t m, int64_t k, int limbs) {
    const size_t blocks = (size_t)(m * (k / QK));
    x->q = (int8_t *)malloc((size_t)(m * k) * (size_t)limbs);
    x->dx = (float *)malloc(blocks * 2 * sizeof(float) + blocks * 4 * sizeof(int32_t) +
                   (size_t)m * sizeof(int32_t));
    if (!x->q || !x->dx) {
        free(x->q);
        free(x->dx);
        return 0;
    }
    x->sx = x->dx + blocks;
    x->first = (int32_t *)(x->sx + blocks);
    x->rest = x->first + blocks;
    x->half = x->rest + blocks;
    x->shift = x->half + 2 * blocks;
    return 1;
}

static void xlimbs_free(XLimbs *x) {
    free(x->q);
    free(x->dx);
}

/* The limbs from row r on. */
static inline XLimbs xlimbs_from(const XLimbs *x, int64_t r, int64_t k, int limbs) {
    const int64_t i = r * (k / QK);
    return (XLimbs){x->q + i * QK * limbs, x->dx + i, x->sx + i, x->first + i, x->rest + i,
                    x->half + 2 * i, x->shift + r};
}

/* 16 values at element offset `off` of x (dtype) as floats. */
static inline __m512 x_load16(const void *x, int dtype, int64_t off) {
    return dtype == KILN_F32 ? _mm512_loadu_ps((const float *)x + off)
        : bf16x16_f32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + off)));
}

/* Below 2^TINY_ROW_EXP a row's largest value makes the row tiny: held scaled up. */
#define TINY_ROW_EXP (-32)

/* The power of two a row of nb blocks is held times: 0, or for a row of only tiny finite values
 * (inf and NaN aside) the one that brings its largest to [0.5, 1). */
static int row_shift(const void *x, int dtype, int64_t row, int64_t nb) {
    const __m512 inf = _mm512_set1_ps(INFINITY);
    __m512 most = _mm512_setzero_ps();
    for (int64_t j = 0; j < 2 * nb; ++j) {
        const __m512 a = _mm512_abs_ps(x_load16(x, dtype, (row * nb * 2 + j) * 16));
        most = _mm512_max_ps(most, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, inf, _CMP_LT_OQ), a));
    }
    const float amax = _mm512_reduce_max_ps(most);
    if (amax == 0.f || amax >= ldexpf(1.f, TINY_ROW_EXP)) return 0;
    int e;
    frexpf(amax, &e); /* amax in [2^(e-1), 2^e): subnormals too */
    return -e;
}

/* v * 2^s, exactly while the result is normal, for any s (vscalefps: 2^s itself may be past
 * float32's range, and -ffast-math would fold two multiplies by halves of it into one). */
static inline __m512 times_pow2(__m512 v, int s) {
    return _mm512_scalef_ps(v, _mm512_set1_ps((float)s));
}

/* Rows [r0, r1) of x [.., k] (dtype) into the limbs of xl. An inf or NaN makes its block's
 * scale NaN, so the outputs it reaches are NaN, as a float32 dot product's would be. */
static void quantize_x(const void *x, int dtype, int64_t r0, int64_t r1, int64_t k, int limbs,
                       const XLimbs *xl) {
    const int64_t nb = k / QK;
    const __m512 limb = _mm512_set1_ps((float)(1 << LIMB_SHIFT));
    const __m512 inf = _mm512_set1_ps(INFINITY);
    for (int64_t row = r0; row < r1; ++row) xl->shift[row] = row_shift(x, dtype, row, nb);
    for (int64_t i = r0 * nb; i < r1 * nb; ++i) {
        const int shift = xl->shift[i / nb];
        __m512 v[2];
        for (int h = 0; h < 2; ++h) {
            v[h] = x_load16(x, dtype, i * QK + 16 * h);
            if (shift) v[h] = times_pow2(v[h], shift);
        }
        const __m512 a0 = _mm512_abs_ps(v[0]), a1 = _mm512_abs_ps(v[1]);
        int8_t *q = xl->q + i * QK * limbs;
        if (_mm512_cmp_ps_mask(a0, inf, _CMP_NLT_UQ) | _mm512_cmp_ps_mask(a1, inf, _CMP_NLT_UQ)) {
            memset(q, 0, (size_t)(QK * limbs));
            xl->dx[i] = xl->sx[i] = NAN;
            xl->first[i] = xl->rest[i] = xl->half[2 * i] = xl->half[2 * i + 1] = 0;
            continue;
        }
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
        int e = 0;
        if (amax > 0.f) frexpf(amax, &e); /* amax < 2^e */
        e -= 6;
        /* Below 2^-100 the block counts as zero (its scale 2^-e would overflow): 1e-30 of any
         * other value's contribution */
        const int zero = amax == 0.f || e < -100;
        xl->dx[i] = zero ? 0.f : ldexpf(1.f, e - LIMB_SHIFT * (limbs - 1));
        const __m512 inv = _mm512_set1_ps(zero ? 0.f : ldexpf(1.f, -e));
        __m512i first = _mm512_setzero_si512(), rest = _mm512_setzero_si512();
        for (int h = 0; h < 2; ++h) {
            __m512 t = _mm512_mul_ps(v[h], inv); /* exact: a power of two */
            __m512i held = _mm512_setzero_si512(); /* this half as the limbs hold it, / dx */
            for (int l = 0; l < limbs; ++l) {
                const __m512 r = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                const __m512i ri = _mm512_cvtps_epi32(r);
                _mm_storeu_si128((__m128i *)(q + l * QK + 16 * h), _mm512_cvtepi32_epi8(ri));
                held = _mm512_add_epi32(_mm512_slli_epi32(held, LIMB_SHIFT), ri);
                if (l == 0)
                    first = _mm512_add_epi32(first, ri);
                else /* limb l counts 128^(limbs - 1 - l) in rest */
                    rest = _mm512_add_epi32(rest, _mm512_sllv_epi32(
                        ri, _mm512_set1_epi32(LIMB_SHIFT * (limbs - 1 - l))));
                t = _mm512_mul_ps(_mm512_sub_ps(t, r), limb); /* the remainder, exactly */
            }
            xl->half[2 * i + h] = _mm512_reduce_add_epi32(held); /* < 16 * 65 * 128^2 */
        }
        xl->first[i] = _mm512_reduce_add_epi32(first);
        xl->rest[i] = _mm512_reduce_add_epi32(rest);
        /* The sum of x as the limbs hold it, so that d (q . x) + m sum(x) is w . x for that x:
         * summing x itself would weigh its rounding by q (0..15 for Q4_0) instead of q - 8. */
        xl->sx[i] = (float)(xl->half[2 * i] + xl->half[2 * i + 1]) * xl->dx[i];
    }
}

/* acc + the sums of 4 products u8 * s8 in each int32 lane (vpdpbusd). Without AVX512-VNNI, two
 * multiply-adds do it exactly: a pair of products here is at most 255 * 64 * 2 = 32640 in
 * magnitude, within int16's saturation. */
static inline __m512i dot_add(__m512i acc, __m512i u8, __m512i s8) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, u8, s8);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u8, s8),
                                                   _mm512_set1_epi16(1)));
#endif
}

#endif
