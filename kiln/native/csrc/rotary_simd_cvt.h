/* rotary_simd.h's steps on AVX512-BF16: each rounding of 32 values one VCVTNE2PS2BF16 instead
 * of 10 integer operations, where no value is subnormal; elsewhere (and without the instruction)
 * the bit trick. Included by rotary_simd.h only. */
#ifndef KILN_ROTARY_SIMD_CVT_H
#define KILN_ROTARY_SIMD_CVT_H

#if defined(__AVX512BF16__)

/* The instruction rounds to nearest even and makes NaN quiet as f32_to_bf16 does, but reads a
 * subnormal input as 0 and flushes a subnormal result to 0. With every x at least 2^-63 in
 * magnitude (or inf / NaN) and every nonzero cos / sin at least 2^-56, no product (at least
 * 2^-119) nor sum of two rounded ones (0 or a multiple of 2^-126) is subnormal; a step where
 * an x or a token where a cos / sin is smaller (x = 0 included) takes the bit trick. */
static inline int rotary_tiny_cs(__m512 lo, __m512 hi) { /* 0 < |v| < 2^-56, float32 */
    const __m512i abs = _mm512_set1_epi32(0x7fffffff), one = _mm512_set1_epi32(1);
    const __m512i m1 = _mm512_sub_epi32(_mm512_and_si512(_mm512_castps_si512(lo), abs), one);
    const __m512i m2 = _mm512_sub_epi32(_mm512_and_si512(_mm512_castps_si512(hi), abs), one);
    /* a value below 2^-56 that rounds to it counts too: the trick rounds either way */
    return _mm512_cmplt_epu32_mask(_mm512_min_epu32(m1, m2), _mm512_set1_epi32(0x237fffff)) != 0;
}

/* |x| < 2^-63 for one of 64 bfloat16: its exponent's top two bits (bfloat16 bits 14, 13) 0.
 * One test a register; zeros count, rare in q and k (the steps' tails load 1.0 there). */
static inline int rotary_tiny_x(__m512i v1, __m512i v2) {
    const __m512i top = _mm512_set1_epi16(0x6000);
    return !_kortestz_mask32_u8(_mm512_testn_epi16_mask(v1, top),
                                _mm512_testn_epi16_mask(v2, top));
}

/* Where each output element sits in the rounded sums. Rounding set A's 16 values and set B's
 * into one register and taking its even and odd elements apart (bf16_even / bf16_odd) puts
 * lane l of set S at lane (l & 1 ? odd : even)[S * 8 + l / 2]; the last rounding, of even's
 * lanes then odd's, at element (l & 1) * 16 + S * 8 + l / 2 of r1 (32 + that of r2). */
typedef struct {
    __m512i o1, o2; /* _mm512_permutex2var_epi16 indices into (r1, r2) */
    int neox;
} RotaryPerm;

static inline RotaryPerm rotary_perm(int neox) {
    static const uint16_t iota[32] = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10,
                                      11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
                                      22, 23, 24, 25, 26, 27, 28, 29, 30, 31};
    const __m512i j = _mm512_loadu_si512(iota), one = _mm512_set1_epi16(1);
    /* output element j: neox, pair j (set j & 1, lane j / 2) of r1 (o1) or r2 (o2); gpt-j,
     * pair j / 2 of set A (o1) or B (o2), of r1 where j is even, r2 where odd */
    const __m512i lane_bit = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(j, 1), one), 4);
    const __m512i base = _mm512_or_si512(lane_bit, _mm512_srli_epi16(j, 2));
    const __m512i low = _mm512_and_si512(j, one);
    RotaryPerm p;
    p.o1 = _mm512_or_si512(base, _mm512_slli_epi16(low, neox ? 3 : 5));
    p.o2 = _mm512_or_si512(p.o1, _mm512_set1_epi16(neox ? 32 : 8));
    p.neox = neox;
    return p;
}

/* 32 values rounded together (lo's 16, then hi's), then taken apart as even and odd lanes. */
static inline void rotary_round2(__m512 lo, __m512 hi, __m512 *even, __m512 *odd) {
    const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    *even = bf16_even(w);
    *odd = bf16_odd(w);
}

/* rotary_round_tab_trick, by the instruction where no value is tiny. */
static inline void rotary_round_tab(__m512 lo, __m512 hi, int split, int tiny, float *to) {
    if (tiny) {
        rotary_round_tab_trick(lo, hi, split, to);
    } else if (split) {
        __m512 even, odd;
        rotary_round2(lo, hi, &even, &odd);
        _mm512_storeu_ps(to, even);
        _mm512_storeu_ps(to + 16, odd);
    } else {
        _mm512_storeu_ps(to, bf16x16_f32((__m256i)_mm512_cvtneps_pbh(lo)));
        _mm512_storeu_ps(to + 16, bf16x16_f32((__m256i)_mm512_cvtneps_pbh(hi)));
    }
}

static inline void rotary_step_fast(const RotaryStep *p, const RotaryPerm *perm, __m512i *o1,
                                    __m512i *o2) {
    __m512 xc1[2], xs2[2], xc2[2], xs1[2];
    for (int h = 0; h < 2; ++h) {
        xc1[h] = _mm512_mul_round_ps(p->x1[h], p->c[h], KILN_RNE);
        xs2[h] = _mm512_mul_round_ps(p->x2[h], p->s[h], KILN_RNE);
        xc2[h] = _mm512_mul_round_ps(p->x2[h], p->c[h], KILN_RNE);
        xs1[h] = _mm512_mul_round_ps(p->x1[h], p->s[h], KILN_RNE);
    }
    __m512 a[2], b[2], e[2], f[2]; /* [even, odd] */
    rotary_round2(xc1[0], xc1[1], &a[0], &a[1]);
    rotary_round2(xs2[0], xs2[1], &b[0], &b[1]);
    rotary_round2(xc2[0], xc2[1], &e[0], &e[1]);
    rotary_round2(xs1[0], xs1[1], &f[0], &f[1]);
    const __m512i r1 = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_round_ps(a[1], b[1], KILN_RNE),
                                                    _mm512_sub_round_ps(a[0], b[0], KILN_RNE));
    const __m512i r2 = (__m512i)_mm512_cvtne2ps_pbh(_mm512_add_round_ps(e[1], f[1], KILN_RNE),
                                                    _mm512_add_round_ps(e[0], f[0], KILN_RNE));
    if (perm->neox) { /* each output from one register: VPERMW, half VPERMT2W's cost */
        *o1 = _mm512_permutexvar_epi16(perm->o1, r1);
        *o2 = _mm512_permutexvar_epi16(perm->o1, r2);
    } else {
        *o1 = _mm512_permutex2var_epi16(r1, perm->o1, r2);
        *o2 = _mm512_permutex2var_epi16(r1, perm->o2, r2);
    }
}

#else /* the bit trick everywhere */

typedef struct {
    int neox;
} RotaryPerm;

static inline int rotary_tiny_cs(__m512 lo, __m512 hi) { return (void)lo, (void)hi, 0; }
static inline void rotary_round_tab(__m512 lo, __m512 hi, int split, int tiny, float *to) {
    rotary_round_tab_trick(lo, hi, split, to);
    (void)tiny;
}
static inline int rotary_tiny_x(__m512i v1, __m512i v2) { return (void)v1, (void)v2, 0; }
static inline RotaryPerm rotary_perm(int neox) { return (RotaryPerm){neox}; }
static inline void rotary_step_fast(const RotaryStep *p, const RotaryPerm *perm, __m512i *o1,
                                    __m512i *o2) {
    rotary_step_trick(p, perm->neox, o1, o2);
}

#endif
#endif
