/* rotary.c's bfloat16 rows 32 pairs a step (AVX-512), bit for bit its portable loop: the same
 * products and sums, each rounded to nearest even as dtype.h's f32_to_bf16 rounds. */
#ifndef KILN_ROTARY_SIMD_H
#define KILN_ROTARY_SIMD_H

#include <stdint.h>

#include "bf16_simd.h"
#include "dtype.h"
#include "row_blocks.h" /* block_mask; KILN_RNE: explicitly rounded steps under -ffast-math */

#if KILN_ROW_BLOCKS_AVX512
#define KILN_ROTARY_SIMD 1

/* bf16_round without its NaN test: every value rounded here is a product or sum of bfloat16
 * values, so a NaN is one the hardware made quiet with a zero low half (an input NaN's payload,
 * quieted, or the default NaN), which the sum leaves as it is. */
static inline __m512 rotary_round(__m512 v) {
    return _mm512_castsi512_ps(_mm512_and_si512(bf16_round_bits(_mm512_castps_si512(v)),
                                                KILN_BF16_HI));
}

/* 32 bfloat16 of a row, 1.0 past its end (not tiny); masked only there: on Zen 4 masked loads
 * and stores made a 64-wide head's steps ~10% slower. */
static inline __m512i rotary_load(const uint16_t *p, __mmask32 m) {
    return m == 0xffffffffu ? _mm512_loadu_si512(p)
                            : _mm512_mask_loadu_epi16(_mm512_set1_epi16(0x3f80), m, p);
}

static inline void rotary_store(uint16_t *p, __mmask32 m, __m512i v) {
    if (m == 0xffffffffu)
        _mm512_storeu_si512(p, v);
    else
        _mm512_mask_storeu_epi16(p, m, v);
}

/* One step's 32 pairs as two sets of 16 lanes, A and B: x1, x2 in float32 and the step's cos /
 * sin (the table's 16 for A, then B's). neox: v1 holds the pairs' x1, v2 their x2, and A is
 * the even pairs, B the odd; gpt-j: v1 holds pairs 0-15 interleaved (x1 even elements, x2 odd),
 * v2 pairs 16-31, and A is v1's pairs, B v2's. */
typedef struct {
    __m512 x1[2], x2[2], c[2], s[2];
} RotaryStep;

static inline RotaryStep rotary_step(__m512i v1, __m512i v2, const float *cos, const float *sin,
                                     int neox) {
    RotaryStep p;
    p.x1[0] = bf16_even(v1);
    p.x1[1] = neox ? bf16_odd(v1) : bf16_even(v2);
    p.x2[0] = neox ? bf16_even(v2) : bf16_odd(v1);
    p.x2[1] = bf16_odd(v2);
    for (int h = 0; h < 2; ++h) {
        p.c[h] = _mm512_loadu_ps(cos + 16 * h);
        p.s[h] = _mm512_loadu_ps(sin + 16 * h);
    }
    return p;
}

/* The step rotated with dtype.h's rounding bit trick: r1 = x1 * c - x2 * s and
 * r2 = x2 * c + x1 * s, each product rounded first, back in v1, v2's layout. */
static inline void rotary_step_trick(const RotaryStep *p, int neox, __m512i *o1, __m512i *o2) {
    __m512i r1[2], r2[2];
    for (int h = 0; h < 2; ++h) {
        const __m512 a = rotary_round(_mm512_mul_round_ps(p->x1[h], p->c[h], KILN_RNE));
        const __m512 b = rotary_round(_mm512_mul_round_ps(p->x2[h], p->s[h], KILN_RNE));
        const __m512 e = rotary_round(_mm512_mul_round_ps(p->x2[h], p->c[h], KILN_RNE));
        const __m512 f = rotary_round(_mm512_mul_round_ps(p->x1[h], p->s[h], KILN_RNE));
        r1[h] = bf16_round_bits(_mm512_castps_si512(_mm512_sub_round_ps(a, b, KILN_RNE)));
        r2[h] = bf16_round_bits(_mm512_castps_si512(_mm512_add_round_ps(e, f, KILN_RNE)));
    }
    *o1 = neox ? bf16_join(r1[0], r1[1]) : bf16_join(r1[0], r2[0]);
    *o2 = neox ? bf16_join(r2[0], r2[1]) : bf16_join(r1[1], r2[1]);
}

/* to[0:32] = 32 cos (or sin) values lo, hi rounded as round_to does, NaN included, in
 * rotary_step's order: with split, the even elements then the odd (neox), else as they are. */
static inline void rotary_round_tab_trick(__m512 lo, __m512 hi, int split, float *to) {
    const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                            28, 30);
    const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
    lo = bf16_round(lo);
    hi = bf16_round(hi);
    _mm512_storeu_ps(to, split ? _mm512_permutex2var_ps(lo, evens, hi) : lo);
    _mm512_storeu_ps(to + 16, split ? _mm512_permutex2var_ps(lo, odds, hi) : hi);
}

#include "rotary_simd_cvt.h"

/* One token's cos / sin (the cache's float32 row, [cos | sin] halves of hd / 2) rounded to
 * bfloat16 in the order rotary_step takes them, 32 pairs a step: neox, each step's 16 even
 * pairs then its 16 odd; gpt-j, in order. tab holds 2 * rotary_tab_len(hd) floats. Returns
 * whether a value is tiny (rotary_tiny_cs). */
static inline int rotary_tab_len(int hd) { return (hd / 2 + 31) / 32 * 32; }

static inline int rotary_bf16_tab(const float *src, int hd, int neox, float *tab) {
    const int half = hd / 2, len = rotary_tab_len(hd);
    int tiny = 0;
    for (int part = 0; part < 2; ++part) { /* cos, then sin */
        const float *from = src + part * half;
        float *to = tab + part * len;
        for (int i = 0; i < half; i += 32) {
            const __mmask32 m = block_mask(half - i);
            const __m512 lo = _mm512_maskz_loadu_ps((__mmask16)m, from + i);
            const __m512 hi = _mm512_maskz_loadu_ps((__mmask16)(m >> 16), from + i + 16);
            const int t = rotary_tiny_cs(lo, hi);
            rotary_round_tab(lo, hi, neox, t, to + i);
            tiny |= t;
        }
    }
    return tiny;
}

/* One token's [heads, hd] bfloat16 row of x rotated into out (which may be x: each step reads
 * before it writes), with tab (and its tininess) from rotary_bf16_tab and perm from
 * rotary_perm(neox). */
static inline __attribute__((always_inline)) void rotary_bf16_row(
    const uint16_t *x, uint16_t *out, int heads, int hd, const float *tab, int tiny_tab,
    const RotaryPerm *perm, int neox) {
    const int half = hd / 2, len = rotary_tab_len(hd);
    /* steps outside, heads inside: a step's masks and cos / sin serve every head */
    for (int i = 0; i < half; i += 32) {
        /* neox: x1 at x[i:], x2 at x[half + i:]; gpt-j: the step's 64 elements in order */
        const int64_t at1 = neox ? i : 2 * i, at2 = neox ? half + i : 2 * i + 32;
        const __mmask32 m1 = block_mask(neox ? half - i : 2 * (half - i));
        const __mmask32 m2 = neox ? m1 : block_mask(2 * (half - i) - 32);
        for (int h = 0; h < heads; ++h) {
            const __m512i v1 = rotary_load(x + h * hd + at1, m1);
            const __m512i v2 = rotary_load(x + h * hd + at2, m2);
            const RotaryStep p = rotary_step(v1, v2, tab + i, tab + len + i, neox);
            __m512i o1, o2;
            if (tiny_tab || rotary_tiny_x(v1, v2))
                rotary_step_trick(&p, neox, &o1, &o2);
            else
                rotary_step_fast(&p, perm, &o1, &o2);
            rotary_store(out + h * hd + at1, m1, o1);
            rotary_store(out + h * hd + at2, m2, o2);
        }
    }
}

#endif
#endif
