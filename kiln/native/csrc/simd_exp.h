/* e^x and 2^x on 16 float32 lanes for the AVX-512 kernels (layer_ops.c's SiLU, the prefill
 * attention's softmax): the library's polynomials. */
#ifndef KILN_SIMD_EXP_H
#define KILN_SIMD_EXP_H

#if defined(__AVX512F__)
#include <immintrin.h>

#define KILN_EXP_RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* e^x, inline: x = k ln2 + r, |r| <= ln2 / 2 (ln2 in two parts), e^r by Cephes' expf
 * polynomial, times 2^k (VSCALEFPS: inf past 88.7, subnormals below -87); 0 from -104 down, for
 * -inf (whose reduction is NaN), for a masked attention score (-1e30 less the row's maximum)
 * and for NaN (silu's quotient is NaN all the same). Within 1 ulp
 * of e^x; libmvec's vector expf, which GCC calls for a vectorized expf, is within 2.6 and costs
 * a call per 16 values. Explicit FMAs: -ffast-math reassociates none of these builtins. */
static inline __attribute__((always_inline)) __m512 kiln_exp512(__m512 x) {
    const __m512 k = _mm512_roundscale_ps(
        _mm512_mul_round_ps(x, _mm512_set1_ps(1.44269504f), KILN_EXP_RNE), KILN_EXP_RNE);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_round_ps(r, r, KILN_EXP_RNE), r);
    p = _mm512_add_round_ps(p, _mm512_set1_ps(1.f), KILN_EXP_RNE);
    return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-104.f), _CMP_GT_OQ), p, k);
}

/* 2^x, inline, for callers that fold log2(e) into a scale they apply anyway (the prefill
 * attention's softmax: one FMA makes its argument from a raw score): x = k + r, |r| <= 1/2, 2^r
 * by a degree-6 polynomial (fitted near-minimax on [-1/2, 1/2]: within 8e-8 of 2^r), times 2^k;
 * 0 from -150 down, for -inf and for NaN. Four operations fewer than kiln_exp512 (no ln2
 * reduction, one polynomial term less to set up). */
static inline __attribute__((always_inline)) __m512 kiln_exp2_512(__m512 x) {
    const __m512 k = _mm512_roundscale_ps(x, KILN_EXP_RNE);
    const __m512 r = _mm512_sub_ps(x, k);
    __m512 p = _mm512_set1_ps(1.5345810970757157e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3399930903688073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.618489071726799e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.550328642129898e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022646248340607e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.931471824645996e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-150.f), _CMP_GT_OQ), p, k);
}

/* 2^x as kiln_exp2_512 for values to be rounded to bfloat16 (the prefill attention's
 * probabilities before P.V): a degree-3 polynomial (fitted near-minimax on [-1/2, 1/2], 2^0
 * exact), within 1.0e-4 of 2^x relative, a twentieth of bfloat16's half ulp (2^-9). Three FMAs
 * fewer than kiln_exp2_512. */
static inline __attribute__((always_inline)) __m512 kiln_exp2_bf16_512(__m512 x) {
    const __m512 k = _mm512_roundscale_ps(x, KILN_EXP_RNE);
    const __m512 r = _mm512_sub_ps(x, k);
    __m512 p = _mm512_set1_ps(0.05500893294811249f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.2422109693288803f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.6932829022407532f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-150.f), _CMP_GT_OQ), p, k);
}
#endif

#endif
