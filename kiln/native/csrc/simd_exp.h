/* e^x on 16 float32 lanes for the AVX-512 kernels (layer_ops.c's SiLU, the prefill attention's
 * softmax): one polynomial for the whole library. */
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
#endif

#endif
