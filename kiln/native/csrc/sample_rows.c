/* One draw a row from softmax(logits * scale) in two passes over the logits, without the
 * probability table: kiln/sample/inverse_cdf.py's two-level inverse CDF (blocks of 256, sums in
 * float64) over exp((x - max) * scale), which the softmax's division only rescales.
 *
 * The library builds with -ffast-math, which lets GCC assume no infinities: a masked logit
 * (-inf) is never compared as a float here. The AVX-512 e^x gives 0 for it (simd_exp.h); the
 * scalar path tests its bits. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define SAMPLE_BLOCK 256 /* inverse_cdf.py's BLOCK: the same draw on the same uniform */
#define STACK_BLOCKS 2048 /* block sums on the stack up to a 512k vocabulary */

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>

#include "simd_exp.h"

/* max of x [n] (-inf when every value is -inf) */
static float row_max(const float *x, int64_t n) {
    __m512 m = _mm512_set1_ps(-__builtin_inff());
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + i));
    if (i < n) {
        const __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
        m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, x + i));
    }
    return _mm512_reduce_max_ps(m);
}

/* exp((x - top) * scale) of x [n <= SAMPLE_BLOCK] into e (if not NULL), their float64 sum */
static double block_exp(const float *x, int64_t n, float scale, float top, float *e) {
    const __m512 s = _mm512_set1_ps(scale), t = _mm512_set1_ps(top);
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m512 y = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), t), s);
        const __m512 v = _mm512_maskz_mov_ps(k, kiln_exp512(y));
        if (e) _mm512_mask_storeu_ps(e + i, k, v);
        lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
        hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1)));
    }
    return _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
}
#else
#include <math.h>

static int neg_inf(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return u == 0xff800000u;
}

static float row_max(const float *x, int64_t n) {
    float m = -__builtin_inff();
    for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
    return m;
}

static double block_exp(const float *x, int64_t n, float scale, float top, float *e) {
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) {
        const float v = neg_inf(x[i]) ? 0.f : expf((x[i] - top) * scale);
        if (e) e[i] = v;
        sum += v;
    }
    return sum;
}
#endif

static int all_masked(float top) {
    uint32_t u;
    memcpy(&u, &top, sizeof u);
    return u == 0xff800000u;
}

/* The row's index: the first block whose running float64 sum passes u * total, then the first
 * entry of it whose running sum passes what is left; each clamped to the last entry with mass,
 * as inverse_cdf does where rounding would step past it. */
static int64_t sample_row(const float *x, int64_t vocab, float scale, double u, double *sums) {
    if (vocab == 0) return 0;
    /* The maximum subtracted before the scale, not x * scale - max * scale: GCC contracts that
     * into an FMA, whose unrounded product left the top token e^(+-128) at logits * scale near
     * 2^31 (a sharp temperature on penalized logits), a row of zeros or infinities. */
    const float top = row_max(x, vocab);
    if (all_masked(top)) return 0;
    const int64_t blocks = (vocab + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    double total = 0;
    int64_t last = 0;
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t start = b * SAMPLE_BLOCK;
        const int64_t n = vocab - start < SAMPLE_BLOCK ? vocab - start : SAMPLE_BLOCK;
        sums[b] = block_exp(x + start, n, scale, top, NULL);
        total += sums[b];
        if (sums[b] > 0) last = b;
    }
    const double target = u * total;
    int64_t b = 0;
    double before = 0;
    while (b < last && before + sums[b] <= target) before += sums[b++];
    float e[SAMPLE_BLOCK];
    const int64_t start = b * SAMPLE_BLOCK;
    const int64_t n = vocab - start < SAMPLE_BLOCK ? vocab - start : SAMPLE_BLOCK;
    block_exp(x + start, n, scale, top, e); /* the same lanes as the first pass: the same values */
    int64_t j = 0, last_j = 0;
    for (int64_t i = 0; i < n; ++i)
        if (e[i] > 0) last_j = i;
    double run = e[0];
    while (j < last_j && run <= target - before) run += e[++j];
    return start + j;
}

/* out[r] = the index drawn for row r of logits [rows, vocab] (row stride x_stride) with
 * probabilities softmax(logits[r] * scale[r]) and uniform u[r] in [0, 1). 2 = out of memory. */
int kiln_sample_rows(const float *logits, int64_t x_stride, int64_t rows, int64_t vocab,
                     const float *scale, const double *u, int64_t *out, int32_t num_threads) {
    const int64_t blocks = (vocab + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    int failed = 0;
#pragma omp parallel for num_threads(num_threads) if (rows > 1) reduction(| : failed)
    for (int64_t r = 0; r < rows; ++r) {
        double stack_sums[blocks <= STACK_BLOCKS && blocks > 0 ? blocks : 1];
        double *heap = blocks <= STACK_BLOCKS ? NULL : (double *)malloc(blocks * sizeof(double));
        if (blocks > STACK_BLOCKS && !heap) {
            failed = 1;
            continue;
        }
        out[r] = sample_row(logits + r * x_stride, vocab, scale[r], u[r], heap ? heap : stack_sums);
        free(heap);
    }
    return failed ? 2 : 0;
}
