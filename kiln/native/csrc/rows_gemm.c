/* out [m, n] = x [m, k] @ w [n, k]^T over the weight as stored, for the float MoE experts on CPUs
 * without AMX tiles (moe_experts.cpp's ROUTE_ROWS): AMD Zen 4 / 5, Ice Lake, Cascade Lake.
 *
 * Dot-product form, register-blocked: RB rows of x against CB weight rows at a time, RB x CB
 * float32 vector sums over k, each weight vector loaded once for the RB rows; the sums reduced
 * 16 at a time by a transposing add tree at the end of k. A thread takes NB weight rows (held in
 * L2) and passes every row block of x over them, so a few rows stream the weight once and many
 * reuse it from cache. bfloat16: AVX512-BF16's VDPBF16PS, 32 k a step, on the bfloat16 rows as
 * they are; without it (AVX-512F) x widened to float32 once a call and each weight vector on
 * load, FMA 16 k a step; float32 the same FMA kernel. float32 sums rounded once, as oneDNN's GEMM
 * rounds them. VDPBF16PS reads bfloat16 subnormals (below 2^-126) as zero and flushes subnormal
 * sums, as it is defined to; the FMA kernels and torch's GEMM keep them (a difference below
 * 2^-126 |w| k, unseen next to a normal row's products). k past a multiple of the step: masked
 * loads (zeros, never read past a row); weight rows past n: the last row again, sums dropped. */
#include <stdint.h>
#include <stdlib.h>

#include "bf16_simd.h"
#include "dtype.h"
#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

/* Rows of x a block: 4 x 4 blocks were within 5% of 6 x 4, 8 x 3 and 8 x 2 (docs/measurements.md),
 * so the block functions below are instantiated for 1-4 rows only. */
#define RB 4
#ifndef CB
#define CB 4 /* weight rows a block */
#endif
#ifndef NB
#define NB 32 /* weight rows a thread's pass over every row block of x */
#endif

enum { MODE_F32, MODE_WIDEN, MODE_BF16 };

/* lane i = the sum of a[i]'s 16 lanes, for 16 vectors: pairs of lanes, then 64-bit halves, then
 * 128-bit lanes twice (45 instructions where 16 separate reductions take about 128). */
static inline __m512 sum16(const __m512 *a) {
    __m512 v[8], w[4], x[2];
    for (int i = 0; i < 8; ++i)
        v[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; ++i) { /* w[i]'s lane L: accumulators 4i .. 4i + 3, their lane L */
        const __m512d p = _mm512_castps_pd(v[2 * i]), q = _mm512_castps_pd(v[2 * i + 1]);
        w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p, q)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(p, q)));
    }
    for (int i = 0; i < 2; ++i)
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88),
                         _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
}

/* A weight vector at w + i (elements), `mask` of its k (MODE_BF16: 32 a step, else 16). */
static inline __attribute__((always_inline)) __m512 load_w(const void *w, int64_t i, int mode,
                                                           __mmask32 mask) {
    if (mode == MODE_F32) return _mm512_maskz_loadu_ps((__mmask16)mask, (const float *)w + i);
    const uint16_t *p = (const uint16_t *)w + i;
    if (mode == MODE_BF16) return _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(mask, p));
    return bf16x16_f32(_mm256_maskz_loadu_epi16((__mmask16)mask, p));
}

static inline __attribute__((always_inline)) __m512 load_x(const void *x, int64_t i, int mode,
                                                           __mmask32 mask) {
    if (mode == MODE_BF16)
        return _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(mask, (const uint16_t *)x + i));
    return _mm512_maskz_loadu_ps((__mmask16)mask, (const float *)x + i);
}

static inline __attribute__((always_inline)) __m512 madd(__m512 acc, __m512 x, __m512 w,
                                                         int mode) {
#if defined(__AVX512BF16__)
    if (mode == MODE_BF16)
        return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_castps_si512(x),
                                (__m512bh)_mm512_castps_si512(w));
#endif
    return _mm512_fmadd_ps(x, w, acc);
}

/* sums [R][CB] = rows xr[0 .. R) . weight rows wr[0 .. CB), over k. */
static inline __attribute__((always_inline)) void block(const void *const *xr,
                                                        const void *const *wr, int64_t k, int R,
                                                        int mode, float *sums) {
    const int64_t step = mode == MODE_BF16 ? 32 : 16;
    __m512 acc[8 * CB];
    for (int i = 0; i < R * CB; ++i) acc[i] = _mm512_setzero_ps();
    int64_t kk = 0;
    for (; kk + step <= k; kk += step) {
        __m512 wv[CB];
        for (int c = 0; c < CB; ++c) wv[c] = load_w(wr[c], kk, mode, ~(__mmask32)0);
        for (int r = 0; r < R; ++r) {
            const __m512 xv = load_x(xr[r], kk, mode, ~(__mmask32)0);
            for (int c = 0; c < CB; ++c) acc[r * CB + c] = madd(acc[r * CB + c], xv, wv[c], mode);
        }
    }
    if (kk < k) {
        const __mmask32 mask = ((__mmask32)1 << (k - kk)) - 1;
        __m512 wv[CB];
        for (int c = 0; c < CB; ++c) wv[c] = load_w(wr[c], kk, mode, mask);
        for (int r = 0; r < R; ++r) {
            const __m512 xv = load_x(xr[r], kk, mode, mask);
            for (int c = 0; c < CB; ++c) acc[r * CB + c] = madd(acc[r * CB + c], xv, wv[c], mode);
        }
    }
    for (int i = 0; i < R * CB; i += 16) {
        __m512 a[16];
        for (int j = 0; j < 16; ++j) a[j] = i + j < R * CB ? acc[i + j] : _mm512_setzero_ps();
        float s[16];
        _mm512_storeu_ps(s, sum16(a));
        for (int j = 0; j < 16 && i + j < R * CB; ++j) sums[i + j] = s[j];
    }
}

/* One (rows, weight rows) block of R rows, each mode its own instantiation. */
#define BLOCK_FN(R, MODE)                                                                      \
    static void block_##MODE##_##R(const void *const *xr, const void *const *wr, int64_t k,   \
                                   float *sums) {                                             \
        block(xr, wr, k, R, MODE, sums);                                                       \
    }
#define BLOCK_FNS(MODE)                                                                        \
    BLOCK_FN(1, MODE) BLOCK_FN(2, MODE) BLOCK_FN(3, MODE) BLOCK_FN(4, MODE)
#define BLOCK_ROW(MODE)                                                                        \
    {block_##MODE##_1, block_##MODE##_2, block_##MODE##_3, block_##MODE##_4}
BLOCK_FNS(MODE_F32)
BLOCK_FNS(MODE_WIDEN)
#if defined(__AVX512BF16__)
BLOCK_FNS(MODE_BF16)
#endif

typedef void (*BlockFn)(const void *const *, const void *const *, int64_t, float *);

static BlockFn block_fn(int mode, int r) {
    static const BlockFn table[3][RB] = {
        BLOCK_ROW(MODE_F32),
        BLOCK_ROW(MODE_WIDEN),
#if defined(__AVX512BF16__)
        BLOCK_ROW(MODE_BF16),
#else
        {NULL},
#endif
    };
    return table[mode][r - 1];
}

int kiln_rows_gemm_isa(int32_t dtype) {
#if defined(__AVX512BF16__)
    if (dtype == KILN_BF16) return KILN_ROWS_BF16_DOT;
#endif
    return dtype == KILN_F32 || dtype == KILN_BF16 ? KILN_ROWS_AVX512F : KILN_ROWS_NONE;
}

int kiln_rows_gemm(const void *x, const void *w, void *out, int64_t ldo, int64_t m, int64_t n,
                   int64_t k, int32_t dtype, int32_t num_threads) {
    if (m < 1 || n < 1 || k < 1 || ldo < n || kiln_rows_gemm_isa(dtype) == KILN_ROWS_NONE)
        return 1;
    const int mode = dtype == KILN_F32 ? MODE_F32
                     : kiln_rows_gemm_isa(dtype) == KILN_ROWS_BF16_DOT ? MODE_BF16 : MODE_WIDEN;
    const size_t xes = mode == MODE_BF16 ? 2 : 4; /* bytes an element of x as the blocks read it */
    float *wide = NULL;                            /* MODE_WIDEN: x in float32 [m, k] */
    if (mode == MODE_WIDEN) {
        wide = (float *)malloc((size_t)(m * k) * sizeof(float));
        if (!wide) return 2;
        const uint16_t *xp = (const uint16_t *)x;
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t i = 0; i < m * k; ++i) wide[i] = bf16_to_f32(xp[i]);
    }
    const char *xs = wide ? (const char *)wide : (const char *)x, *ws = (const char *)w;
    const size_t wes = dtype == KILN_F32 ? 4 : 2;
    const int64_t blocks = (n + NB - 1) / NB;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t n0 = b * NB, n1 = n0 + NB < n ? n0 + NB : n;
        for (int64_t r0 = 0; r0 < m; r0 += RB) {
            const int r = m - r0 < RB ? (int)(m - r0) : RB;
            const void *xr[RB];
            for (int i = 0; i < r; ++i) xr[i] = xs + (size_t)((r0 + i) * k) * xes;
            const BlockFn fn = block_fn(mode, r);
            for (int64_t c0 = n0; c0 < n1; c0 += CB) {
                const void *wr[CB];
                for (int c = 0; c < CB; ++c) /* past n: the last row again, its sums dropped */
                    wr[c] = ws + (size_t)((c0 + c < n1 ? c0 + c : n1 - 1) * k) * wes;
                float sums[RB * CB];
                fn(xr, wr, k, sums);
                for (int i = 0; i < r; ++i)
                    for (int c = 0; c < CB && c0 + c < n1; ++c)
                        store_elem(out, (r0 + i) * ldo + c0 + c, sums[i * CB + c], dtype);
            }
        }
    }
    free(wide);
    return 0;
}

#else /* built without AVX-512: the callers keep the GEMV kernel and aten's GEMM */

int kiln_rows_gemm_isa(int32_t dtype) { return KILN_ROWS_NONE; }
int kiln_rows_gemm(const void *x, const void *w, void *out, int64_t ldo, int64_t m, int64_t n,
                   int64_t k, int32_t dtype, int32_t num_threads) {
    return 1;
}
#endif
