/* An fp8 KV cache's conversions 16 or 32 at a time (AVX512BW): fp8 -> bfloat16 by table (both
 * formats hold only bfloat16 values), float32 -> fp8 as dtype.h's f32_to_fp8 rounds, bit for bit. */
#ifndef KILN_FP8_SIMD_H
#define KILN_FP8_SIMD_H

#include "bf16_simd.h"
#include "dtype.h"

#if defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define KILN_FP8_SIMD 1

/* The bfloat16 bits of fp8 magnitudes 0..127 (fp8_to_f32 then f32_to_bf16, exact), as constant
 * expressions. e4m3fn: exponent bias 7 against bfloat16's 127, subnormals m * 2^-9 (m's top bit
 * at exponent 118 + p, p = floor(log2 m)), 0x7f NaN. e5m2: bias 15, subnormals m * 2^-16,
 * exponent 31 infinity (m = 0) or NaN. */
#define KILN_LOG2_3(m) ((m) >= 4 ? 2 : (m) >= 2 ? 1 : 0)
#define KILN_SUB_BF16(m, e0)                                                              \
    ((m) == 0 ? 0 : (e0 + KILN_LOG2_3(m)) << 7 | (((m) << (7 - KILN_LOG2_3(m))) & 0x7f))
#define KILN_E4M3_BF16(i)                                                                     \
    ((i) == 0x7f ? 0x7fc0 : ((i) >> 3) == 0 ? KILN_SUB_BF16((i) & 7, 118)                  \
                                             : (((i) >> 3) + 120) << 7 | ((i) & 7) << 4)
#define KILN_E5M2_BF16(i)                                                                     \
    (((i) >> 2) == 31 ? (((i) & 3) ? 0x7fc0 : 0x7f80)                                         \
     : ((i) >> 2) == 0 ? KILN_SUB_BF16((i) & 3, 111)                                       \
                       : (((i) >> 2) + 112) << 7 | ((i) & 3) << 5)
#define KILN_R4(f, i) f(i), f((i) + 1), f((i) + 2), f((i) + 3)
#define KILN_R16(f, i) KILN_R4(f, i), KILN_R4(f, (i) + 4), KILN_R4(f, (i) + 8), KILN_R4(f, (i) + 12)
#define KILN_R64(f, i)                                                                        \
    KILN_R16(f, i), KILN_R16(f, (i) + 16), KILN_R16(f, (i) + 32), KILN_R16(f, (i) + 48)

static const uint16_t kiln_fp8_bf16_tab[2][128] __attribute__((aligned(64))) = {
    {KILN_R64(KILN_E4M3_BF16, 0), KILN_R64(KILN_E4M3_BF16, 64)},
    {KILN_R64(KILN_E5M2_BF16, 0), KILN_R64(KILN_E5M2_BF16, 64)}};

typedef struct {
    __m512i t[4]; /* the format's table, 32 words a register */
} Fp8Tab;

/* Loaded once before a loop, so that the table stays in registers. */
static inline Fp8Tab fp8_tab(int kv_dtype) {
    const uint16_t *t = kiln_fp8_bf16_tab[kv_dtype == KILN_FP8E5M2];
    Fp8Tab r;
    for (int i = 0; i < 4; ++i) r.t[i] = _mm512_load_si512(t + 32 * i);
    return r;
}

/* 32 fp8 bytes as bfloat16 words: the magnitude's low 6 bits pick a word from two registers
 * (one VPERMT2W for each half of the table), bit 6 the half, the sign goes on top. */
static inline __m512i fp8x32_bf16(const uint8_t *src, const Fp8Tab *tab) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)src));
    const __m512i lo = _mm512_permutex2var_epi16(tab->t[0], w, tab->t[1]);
    const __m512i hi = _mm512_permutex2var_epi16(tab->t[2], w, tab->t[3]);
    const __m512i mag =
        _mm512_mask_blend_epi16(_mm512_test_epi16_mask(w, _mm512_set1_epi16(0x40)), lo, hi);
    /* mag | (w << 8 & 0x8000) */
    return _mm512_ternarylogic_epi32(mag, _mm512_slli_epi16(w, 8), _mm512_set1_epi16(-0x8000),
                                     0xf8);
}

/* 16 fp8 bytes as float32. */
static inline __m512 fp8x16_f32(const uint8_t *src, const Fp8Tab *tab) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)src));
    const __m512i wz = _mm512_castsi256_si512(w);
    const __m512i lo = _mm512_permutex2var_epi16(tab->t[0], wz, tab->t[1]);
    const __m512i hi = _mm512_permutex2var_epi16(tab->t[2], wz, tab->t[3]);
    const __m256i mag = _mm512_castsi512_si256(
        _mm512_mask_blend_epi16(_mm512_test_epi16_mask(wz, _mm512_set1_epi16(0x40)), lo, hi));
    const __m256i b = _mm256_ternarylogic_epi32(mag, _mm256_slli_epi16(w, 8),
                                                _mm256_set1_epi16(-0x8000), 0xf8);
    return bf16x16_f32(b);
}

/* 16 float32 lanes (as bits) as fp8 bytes, exactly as f32_to_fp8: saturated at the format's
 * largest finite value, NaN as sign | 0x7f, subnormals rounded to nearest even by adding a
 * power of two whose float32 step is the format's subnormal step (2^14: 2^-9, 2^7: 2^-16),
 * normals by f32_to_fp8's integer rounding. */
static inline __m128i f32x16_fp8(__m512i u, int kv_dtype) {
    const int e4 = kv_dtype == KILN_FP8E4M3, drop = e4 ? 20 : 21;
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
    const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7f800000));
    const __mmask16 sat = _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(e4 ? 0x43e00000 : 0x47600000));
    const __mmask16 sub = _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(e4 ? 0x3c800000 : 0x38800000));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, drop), _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(
        a, _mm512_add_epi32(odd, _mm512_set1_epi32((1 << (drop - 1)) - 1)));
    /* (exponent << mbits | mantissa) rebased from float32's bias to the format's */
    __m512i r = _mm512_sub_epi32(_mm512_srli_epi32(up, drop),
                                 _mm512_set1_epi32(e4 ? 120 << 3 : 112 << 2));
    const __m512 magic = _mm512_castsi512_ps(_mm512_set1_epi32(e4 ? 0x46800000 : 0x43000000));
    const __m512 steps = _mm512_add_round_ps(_mm512_castsi512_ps(a), magic,
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm512_mask_sub_epi32(r, sub, _mm512_castps_si512(steps), _mm512_castps_si512(magic));
    r = _mm512_mask_mov_epi32(r, sat, _mm512_set1_epi32(e4 ? 0x7e : 0x7b));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7f));
    return _mm512_cvtepi32_epi8(_mm512_or_si512(r, sign));
}
#else
#define KILN_FP8_SIMD 0
#endif

#endif
