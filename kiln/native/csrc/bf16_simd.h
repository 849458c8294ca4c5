/* float32 <-> bfloat16 in AVX-512 registers, bit for bit dtype.h's f32_to_bf16 / bf16_to_f32:
 * the one copy of the rounding's bit trick and of the even / odd lane split the kernels share. */
#ifndef KILN_BF16_SIMD_H
#define KILN_BF16_SIMD_H

#if defined(__AVX512F__)
#include <immintrin.h>

#define KILN_BF16_HI _mm512_set1_epi32((int)0xffff0000u)

/* f32_to_bf16's u + 0x7fff + lsb: each lane's bfloat16 in its top half (the bottom half is left
 * over), without the NaN branch. Alone only where a NaN cannot have bits in its low half (they
 * could carry into its exponent or sign): bf16_top is the whole rounding. */
static inline __m512i bf16_round_bits(__m512i u) {
    const __mmask16 odd = _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x10000));
    const __m512i r = _mm512_add_epi32(u, _mm512_set1_epi32(0x7fff));
    return _mm512_mask_add_epi32(r, odd, r, _mm512_set1_epi32(1));
}

/* v rounded to bfloat16 as f32_to_bf16 (nearest even; a NaN stays a NaN, made quiet), its bits
 * in the top half of each lane; the bottom half is left over. Not VCVTNEPS2BF16: it flushes
 * subnormals to zero. */
static inline __m512i bf16_top(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
#if defined(__AVX512DQ__)
    const __mmask16 nan = _mm512_fpclass_ps_mask(v, 0x81); /* quiet or signalling NaN */
#else /* the prefill tiles build on AVX512F alone: |u| > inf's bits, one step more */
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
#endif
    return _mm512_mask_or_epi32(bf16_round_bits(u), nan, u, _mm512_set1_epi32(0x00400000));
}

/* v as bfloat16 holds it: round_to(v, KILN_BF16) in each lane. */
static inline __m512 bf16_round(__m512 v) {
    return _mm512_castsi512_ps(_mm512_and_si512(bf16_top(v), KILN_BF16_HI));
}

/* 16 lanes as 16 bfloat16 (f32_to_bf16 of each). */
static inline __m256i bf16x16(__m512 v) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_top(v), 16));
}

/* 16 bfloat16 as float32 (exact). */
static inline __m512 bf16x16_f32(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 32 bfloat16 in a register as two sets of 16 float32: the even elements (each lane's low half)
 * and the odd ones (its high half), a shift and a mask, no shuffles. */
static inline __m512 bf16_even(__m512i w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); }
static inline __m512 bf16_odd(__m512i w) { return _mm512_castsi512_ps(_mm512_and_si512(w, KILN_BF16_HI)); }

/* bf16_even / bf16_odd undone: 32 bfloat16 from the top halves of even's lanes and odd's. */
static inline __m512i bf16_join(__m512i even, __m512i odd) {
    /* (odd & 0xffff0000) | (even >> 16) */
    return _mm512_ternarylogic_epi32(odd, _mm512_srli_epi32(even, 16), KILN_BF16_HI, 0xEC);
}

#endif

#endif
