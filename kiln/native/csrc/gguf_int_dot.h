/* gguf_matmul.c's kernel for Q4_0, Q4_1, Q4_K, Q5_K and Q8_0 blocks: x cut into int8 limbs,
 * integer dot products (AVX512-VNNI) against the weight's integers, made unsigned, 16 output
 * rows per register (Q8_0's differences: group_rows_q8).
 *
 * A block's w . x = d (q . x) + m sum(x). With x held in integers, q . x is exact, and vpdpbusd
 * does 64 of its products an instruction against a float32 FMA's 16 (at the same rate here,
 * one a cycle). Three limbs take 24 of them per 16 outputs, 32 values and row of x, against the
 * float32 kernel's 32 FMAs, and no table lookups. The default model's 120 linear shapes (random
 * Q4_1 weights, 2 cores, the float32 kernel's time / this one's): float32 1.01-1.05x at 1 row
 * (bound by memory), 1.30x at 2, 1.49-1.52x at 4, 1.44-1.49x at 8, 1.47x at 16, 1.19x at 32;
 * bfloat16 1.12x at 1, 1.28x at 4, 1.34x at 8, 1.43x at 16.
 *
 * Each 32 values of a row of x become `limbs` int8 vectors with a power-of-two scale 2^e chosen
 * so |x| / 2^e < 64: x = 2^e (h + l1 / 128 + l2 / 128^2), h and each l in [-64, 64], every limb
 * rounded to nearest. Three limbs (float32 x) hold x to 2^-20 of the block's largest value: a
 * linear's outputs come within 1-4e-6 of the largest of the exact ones, where a float32 GEMM's
 * come within 3-5e-7. Two limbs (bfloat16 x) hold it to 2^-13, finer than bfloat16 does. The
 * limbs' dot products are summed in one int32 lane each, ((q.h << 7) + q.l1) << 7 + q.l2, at
 * most 32 * 31 * 64 * 128^2 + ... < 2^31 for 5-bit q. The power-of-two scale keeps exact inputs
 * exact: a one-hot x yields a weight's value to the bit, d * q + m rounded once as dequantize
 * rounds it.
 *
 * The weight comes in groups of GROUP_ROWS output rows (gguf_layout.c), a group's 32-value
 * block as [16 float32 d][16 float32 m][4 x 64 bytes of nibbles] (+ 8 x 64-bit fifth-bit masks
 * for 5-bit blocks): byte 4c + i of nibble vector j holds values 4j + i (low) and 16 + 4j + i
 * (high) of row c. Low nibbles of vector j and high ones of vector j are then values 4j .. 4j +
 * 3 and 4 (j + 4) .. + 3 of all 16 rows, against x's dwords j and j + 4, broadcast. */
#ifndef KILN_GGUF_INT_DOT_H
#define KILN_GGUF_INT_DOT_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "dtype.h"
#include "gguf_blocks.h"

#define LIMB_SHIFT 7
/* Group blocks a loop asks for ahead of the one it reads (see PREFETCH_BLOCKS). */
#define GROUP_PREFETCH_BLOCKS 8

/* acc + the sums of 4 products u8 * s8 in each int32 lane (vpdpbusd). Without AVX512-VNNI, two
 * multiply-adds do it exactly: a pair of products here is at most 31 * 64 * 2 in magnitude, far
 * from int16's saturation. */
static inline __m512i dot_add(__m512i acc, __m512i u8, __m512i s8) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, u8, s8);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u8, s8),
                                                   _mm512_set1_epi16(1)));
#endif
}

/* Limbs of x [m, k] (dtype): xq [m, k / 32, limbs, 32] int8, the block's scale 2^(e - 7
 * (limbs - 1)) in dx and its sum of x as the limbs hold it in sx; the sums of its first limb in
 * hs and of its others, combined, ((l1 << 7) + l2), in ls; all [m, k / 32]. */
static void quantize_x(const void *x, int dtype, int64_t m, int64_t k, int limbs, int8_t *xq,
                       float *dx, float *sx, int32_t *hs, int32_t *ls) {
    const int64_t nb = k / QK;
    const __m512 limb = _mm512_set1_ps((float)(1 << LIMB_SHIFT));
    for (int64_t i = 0; i < m * nb; ++i) {
        __m512 v[2];
        for (int h = 0; h < 2; ++h)
            v[h] = dtype == KILN_F32
                ? _mm512_loadu_ps((const float *)x + i * QK + 16 * h)
                : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                      (const __m256i *)((const uint16_t *)x + i * QK + 16 * h))), 16));
        const __m512 a0 = _mm512_abs_ps(v[0]), a1 = _mm512_abs_ps(v[1]);
        const __m512 inf = _mm512_set1_ps(INFINITY);
        if (_mm512_cmp_ps_mask(a0, inf, _CMP_NLT_UQ) | _mm512_cmp_ps_mask(a1, inf, _CMP_NLT_UQ)) {
            /* inf or NaN: the block's outputs are NaN, as a float32 dot product's would be */
            memset(xq + i * QK * limbs, 0, (size_t)(QK * limbs));
            dx[i] = sx[i] = NAN;
            hs[i] = ls[i] = 0;
            continue;
        }
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
        int e = 0;
        if (amax > 0.f) frexpf(amax, &e); /* amax < 2^e */
        e -= 6;
        /* Below 2^-100 the block counts as zero (its scale 2^-e would overflow): 1e-30 of any
         * other value's contribution */
        const int zero = amax == 0.f || e < -100;
        dx[i] = zero ? 0.f : ldexpf(1.f, e - LIMB_SHIFT * (limbs - 1));
        const __m512 inv = _mm512_set1_ps(zero ? 0.f : ldexpf(1.f, -e));
        int8_t *q = xq + i * QK * limbs;
        __m512i first = _mm512_setzero_si512(), rest = _mm512_setzero_si512();
        for (int h = 0; h < 2; ++h) {
            __m512 t = _mm512_mul_ps(v[h], inv); /* exact: a power of two */
            for (int l = 0; l < limbs; ++l) {
                const __m512 r = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                const __m512i ri = _mm512_cvtps_epi32(r);
                _mm_storeu_si128((__m128i *)(q + l * QK + 16 * h), _mm512_cvtepi32_epi8(ri));
                if (l == 0)
                    first = _mm512_add_epi32(first, ri);
                else /* limb l counts 128^(limbs - 1 - l) in rest */
                    rest = _mm512_add_epi32(rest, _mm512_sllv_epi32(
                        ri, _mm512_set1_epi32(LIMB_SHIFT * (limbs - 1 - l))));
                t = _mm512_mul_ps(_mm512_sub_ps(t, r), limb); /* the remainder, exactly */
            }
        }
        hs[i] = _mm512_reduce_add_epi32(first);
        ls[i] = _mm512_reduce_add_epi32(rest);
        /* The sum of x as the limbs hold it (exact in int32: at most 32 * 65 * 128^2), so that
         * d (q . x) + m sum(x) is w . x for that x: summing x itself would weigh its rounding by
         * q (0..15 for Q4_0) instead of q - 8. */
        sx[i] = (float)(hs[i] * (1 << (LIMB_SHIFT * (limbs - 1))) + ls[i]) * dx[i];
    }
}

/* out [M, o .. o + 16) = acc (+ bias) in dtype; out's rows are n wide. */
static inline void store_group(const __m512 *acc, int M, const void *bias, void *out, int64_t o,
                               int64_t n, int dtype) {
    for (int r = 0; r < M; ++r) {
        float v[GROUP_ROWS];
        _mm512_storeu_ps(v, acc[r]);
        for (int c = 0; c < GROUP_ROWS; ++c)
            store_elem(out, r * n + o + c, v[c] + (bias ? load_elem(bias, o + c, dtype) : 0.f),
                       dtype);
    }
}

/* Bytes of a group's 32-value block, 4- or 5-bit (five). */
static inline int64_t group_block_bytes(int five) {
    return GROUP_ROWS * (five ? Q5_KERNEL_BYTES : Q4_KERNEL_BYTES);
}

/* Output rows [g0, g1) * GROUP_ROWS for M rows of x in limbs (quantize_x); M and limbs are
 * compile-time constants at each call site, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void group_rows(
        const int8_t *xq, const float *dx, const float *sx, const uint8_t *weight,
        const int five, const void *bias, void *out, const int M, const int limbs, int64_t g0,
        int64_t g1, int64_t n, int64_t k, int dtype) {
    const int64_t nb = k / QK, gbb = group_block_bytes(five);
    const __m512i low = _mm512_set1_epi8(0x0f), sixteen = _mm512_set1_epi8(16);
    for (int64_t g = g0; g < g1; ++g) {
        const uint8_t *wg = weight + g * nb * gbb;
        __m512 acc[MAX_ROWS];
        for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk = wg + b * gbb;
            for (int64_t line = 0; line < gbb; line += 64)
                _mm_prefetch((const char *)(blk + GROUP_PREFETCH_BLOCKS * gbb + line),
                             _MM_HINT_T0);
            const __m512 d = _mm512_loadu_ps(blk), mv = _mm512_loadu_ps(blk + 64);
            __m512i q[8]; /* q[j]: values 4j .. 4j + 3 of the 16 rows */
            for (int j = 0; j < 4; ++j) {
                const __m512i v = _mm512_loadu_si512(blk + 128 + 64 * j);
                q[j] = _mm512_and_si512(v, low);
                q[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            if (five)
                for (int j = 0; j < 8; ++j) {
                    uint64_t bits;
                    memcpy(&bits, blk + 384 + 8 * j, sizeof bits);
                    q[j] = _mm512_mask_add_epi8(q[j], (__mmask64)bits, q[j], sixteen);
                }
            for (int r = 0; r < M; ++r) {
                const int64_t i = r * nb + b;
                const int32_t *xr = (const int32_t *)(xq + i * QK * limbs);
                /* Two chains of dot products per limb, values 0-15 and 16-31: one chain of all
                 * 24 waited on each (8 rows: 1.14x the float32 kernel with one, 1.39x with
                 * one per limb, 1.47x with these six). */
                __m512i dot = _mm512_setzero_si512();
                for (int l = 0; l < limbs; ++l) {
                    __m512i low_half = _mm512_setzero_si512(), high_half = _mm512_setzero_si512();
                    for (int j = 0; j < 4; ++j) {
                        low_half = dot_add(low_half, q[j], _mm512_set1_epi32(xr[8 * l + j]));
                        high_half = dot_add(high_half, q[j + 4],
                                            _mm512_set1_epi32(xr[8 * l + j + 4]));
                    }
                    /* ((h << 7) + l1) << 7 + l2 */
                    dot = _mm512_add_epi32(_mm512_slli_epi32(dot, LIMB_SHIFT),
                                           _mm512_add_epi32(low_half, high_half));
                }
                /* d * 2^e exact, so d (q . x) rounds once */
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                         _mm512_mul_ps(d, _mm512_set1_ps(dx[i])), acc[r]);
                acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sx[i]), acc[r]);
            }
        }
        store_group(acc, M, bias, out, g * GROUP_ROWS, n, dtype);
    }
}

/* group_rows for Q8_0 (Q8_KERNEL_BYTES a value block, q + 128 in 8 vectors as above). The
 * true q . x can outgrow int32 here (32 * 127 * 64 * 128^2), so the first limb's dot product
 * and the others' are kept apart and each corrected for the + 128 exactly in integers (hs, ls:
 * x's limb sums), then joined in float32. */
static inline __attribute__((always_inline)) void group_rows_q8(
        const int8_t *xq, const float *dx, const int32_t *hs, const int32_t *ls,
        const uint8_t *weight, const void *bias, void *out, const int M, const int limbs,
        int64_t g0, int64_t g1, int64_t n, int64_t k, int dtype) {
    const int64_t nb = k / QK, gbb = GROUP_ROWS * Q8_KERNEL_BYTES;
    const float first_weight = (float)(1 << (LIMB_SHIFT * (limbs - 1)));
    for (int64_t g = g0; g < g1; ++g) {
        const uint8_t *wg = weight + g * nb * gbb;
        __m512 acc[MAX_ROWS];
        for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk = wg + b * gbb;
            for (int64_t line = 0; line < gbb; line += 64)
                _mm_prefetch((const char *)(blk + GROUP_PREFETCH_BLOCKS * gbb + line),
                             _MM_HINT_T0);
            const __m512 d = _mm512_loadu_ps(blk);
            __m512i q[8]; /* q[j]: values 4j .. 4j + 3 of the 16 rows, + 128 */
            for (int j = 0; j < 8; ++j) q[j] = _mm512_loadu_si512(blk + 64 + 64 * j);
            for (int r = 0; r < M; ++r) {
                const int64_t i = r * nb + b;
                const int32_t *xr = (const int32_t *)(xq + i * QK * limbs);
                __m512i first = _mm512_setzero_si512(), rest = _mm512_setzero_si512();
                for (int l = 0; l < limbs; ++l) { /* two chains a limb, as group_rows */
                    __m512i low_half = _mm512_setzero_si512(), high_half = _mm512_setzero_si512();
                    for (int j = 0; j < 4; ++j) {
                        low_half = dot_add(low_half, q[j], _mm512_set1_epi32(xr[8 * l + j]));
                        high_half = dot_add(high_half, q[j + 4],
                                            _mm512_set1_epi32(xr[8 * l + j + 4]));
                    }
                    const __m512i dot = _mm512_add_epi32(low_half, high_half);
                    if (l == 0)
                        first = dot;
                    else
                        rest = _mm512_add_epi32(_mm512_slli_epi32(rest, LIMB_SHIFT), dot);
                }
                first = _mm512_sub_epi32(first, _mm512_set1_epi32(128 * hs[i]));
                rest = _mm512_sub_epi32(rest, _mm512_set1_epi32(128 * ls[i]));
                const __m512 s = _mm512_mul_ps(d, _mm512_set1_ps(dx[i])); /* exact */
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(rest), s, acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(first),
                                         _mm512_mul_ps(s, _mm512_set1_ps(first_weight)), acc[r]);
            }
        }
        store_group(acc, M, bias, out, g * GROUP_ROWS, n, dtype);
    }
}

#endif
