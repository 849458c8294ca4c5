/* W8A8 int8 CPU kernels with AVX512-VNNI dot products: symmetric per-token dynamic activation
 * quantization (alone, after RMSNorm with or without the residual add, after SiLU-and-mul) and the
 * int8 GEMM with per-token x per-channel scales (the IR ops' references in kiln/ir/quant.py
 * define each one's result; these equal it exactly where the math is integer).
 *
 * The GEMM reads the weight as stored, int8 [N, K] row-major: VPDPBUSD multiplies unsigned by
 * signed bytes, so each weight vector is offset to unsigned (w ^ 0x80 = w + 128) and the
 * activations stay signed; the offset's 128 * sum(a[m, :]) comes off each row's sums. No packed
 * copy of the weight: int8 weight memory stays one byte a parameter.
 *
 * Float steps use the explicitly rounded intrinsics (_round_ps): the library builds with
 * -ffast-math, under which a plain a * b * c + d could be reassociated or contracted into an FMA,
 * and the results must equal torch's op-by-op float32 rounding bit for bit.
 *
 * dtype: 0 float32, 1 bfloat16. Strides are in elements; columns are contiguous. Return codes:
 * 0 ok, 2 out of memory, 4 built for a CPU without AVX512-VNNI.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"

/* The unfused kernels (layer_ops.c, in the same library) are called whole, so a fused op's normed
 * or activated values are the very ones the unfused op writes. */
#include "kernels.h"
#include "int8_simd.h"
#include "int8_quant_row.h"
#include "int8_fused_quant_rows.h"

/* Fewer rows stay on one thread: from two chunks (CHUNK_ROWS) on, so a decode step's quant ops
 * split across threads (layer_ops.c's unfused kernels start at 64 rows). */
#define PARALLEL_MIN_ROWS (2 * CHUNK_ROWS)

#if KILN_INT8_SIMD

/* Rows a thread normalises or activates into its scratch before quantizing them (in L1/L2). */
#define CHUNK_ROWS 16
/* GEMM blocks one task computes: rows x output channels. */
#define BLOCK_M 64
#define BLOCK_N 32
/* How far ahead of its reads the GEMM prefetches the weight (whole channels, at least 4). */
#define PREFETCH_BYTES 16384

int kiln_int8_isa(void) { return 1; }

/* A chunk's scratch, 64-byte aligned. The unfused kernels give every value the same bits
 * whatever the alignment and row count of their call (layer_ops.c), which the fused ops'
 * equality with them rests on. */
static char *scratch(size_t bytes) { return (char *)aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* q [rows, k] int8, scale [rows] = dynamic_int8_quant(x [rows, k] with row stride x_stride). */
int kiln_dynamic_int8_quant(const void *x, int64_t x_stride, int8_t *q, float *scale,
                            int64_t rows, int64_t k, int32_t dtype, int32_t num_threads) {
    const size_t es = elem_size(dtype);
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_MIN_ROWS)
    for (int64_t r = 0; r < rows; ++r)
        quant_row((const char *)x + r * x_stride * es, k, dtype, q + r * k, scale + r);
    return 0;
}

/* dynamic_int8_quant(rms_norm(x (+ residual))): bfloat16 rows one by one through
 * int8_fused_quant_rows.h's single pass; float32's in chunks through kiln_rms_norm into a
 * per-thread scratch, quantized from there. residual_out [rows, hidden] gets x + residual. */
int kiln_rms_norm_int8_quant(const void *x, int64_t x_stride, const void *residual,
                             int64_t res_stride, void *residual_out, const void *weight, int8_t *q,
                             float *scale, int64_t rows, int32_t hidden, float eps, int32_t dtype,
                             int32_t num_threads) {
    const size_t es = elem_size(dtype);
    const int64_t chunks = (rows + CHUNK_ROWS - 1) / CHUNK_ROWS;
    int failed = 0;
#if KILN_INT8_FUSED_QUANT_ROWS
    if (dtype == KILN_BF16) {
        const size_t padded = ((size_t)hidden + KILN_BLOCK - 1) / KILN_BLOCK * KILN_BLOCK;
#pragma omp parallel num_threads(num_threads) if (rows >= PARALLEL_MIN_ROWS) reduction(| : failed)
        {
            float *buf = (float *)scratch(padded * sizeof(float));
            uint16_t *row = (uint16_t *)scratch(padded * sizeof(uint16_t));
            if (!buf || !row) failed = 1;
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; ++r) {
                if (!buf || !row) continue;
                rms_norm_int8_quant_row(
                    (const char *)x + r * x_stride * es,
                    residual ? (const char *)residual + r * res_stride * es : NULL,
                    residual_out ? (char *)residual_out + r * hidden * es : NULL, weight,
                    q + r * hidden, scale + r, buf, row, hidden, eps);
            }
            free(buf);
            free(row);
        }
        return failed ? 2 : 0;
    }
#endif
#pragma omp parallel num_threads(num_threads) if (rows >= PARALLEL_MIN_ROWS) reduction(| : failed)
    {
        char *buf = scratch((size_t)CHUNK_ROWS * hidden * es);
        if (!buf) failed = 1;
#pragma omp for
        for (int64_t c = 0; c < chunks; ++c) {
            if (!buf) continue;
            const int64_t r0 = c * CHUNK_ROWS, n = rows - r0 < CHUNK_ROWS ? rows - r0 : CHUNK_ROWS;
            if (kiln_rms_norm((const char *)x + r0 * x_stride * es, x_stride,
                              residual ? (const char *)residual + r0 * res_stride * es : NULL,
                              res_stride,
                              residual_out ? (char *)residual_out + r0 * hidden * es : NULL,
                              weight, buf, hidden, n, hidden, eps, dtype, 1)) {
                failed = 1; /* out of memory for a row that large */
                continue;
            }
            for (int64_t r = 0; r < n; ++r)
                quant_row(buf + r * hidden * es, hidden, dtype, q + (r0 + r) * hidden,
                          scale + r0 + r);
        }
        free(buf);
    }
    return failed ? 2 : 0;
}

/* dynamic_int8_quant(silu_and_mul(x [rows, 2d])) -> q [rows, d], scale [rows]: bfloat16 rows
 * one by one in a single pass, float32's in chunks through kiln_silu_and_mul into a per-thread
 * scratch, quantized from there. */
int kiln_silu_and_mul_int8_quant(const void *x, int64_t x_stride, int8_t *q, float *scale,
                                 int64_t rows, int32_t d, int32_t dtype, int32_t num_threads) {
    const size_t es = elem_size(dtype);
    const int64_t chunks = (rows + CHUNK_ROWS - 1) / CHUNK_ROWS;
    int failed = 0;
#if KILN_INT8_FUSED_QUANT_ROWS
    if (dtype == KILN_BF16) { /* rows one by one through int8_fused_quant_rows.h's single pass */
        const size_t padded = ((size_t)d + KILN_BLOCK - 1) / KILN_BLOCK * KILN_BLOCK;
#pragma omp parallel num_threads(num_threads) if (rows >= PARALLEL_MIN_ROWS) reduction(| : failed)
        {
            float *buf = (float *)scratch(padded * sizeof(float));
            uint16_t *row = (uint16_t *)scratch(padded * sizeof(uint16_t));
            if (!buf || !row) failed = 1;
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; ++r) {
                if (!buf || !row) continue;
                silu_and_mul_int8_quant_row((const char *)x + r * x_stride * es, d, q + r * d,
                                            scale + r, buf, row);
            }
            free(buf);
            free(row);
        }
        return failed ? 2 : 0;
    }
#endif
#pragma omp parallel num_threads(num_threads) if (rows >= PARALLEL_MIN_ROWS) reduction(| : failed)
    {
        char *buf = scratch((size_t)CHUNK_ROWS * d * es);
        if (!buf) failed = 1;
#pragma omp for
        for (int64_t c = 0; c < chunks; ++c) {
            if (!buf) continue;
            const int64_t r0 = c * CHUNK_ROWS, n = rows - r0 < CHUNK_ROWS ? rows - r0 : CHUNK_ROWS;
            kiln_silu_and_mul((const char *)x + r0 * x_stride * es, x_stride, buf, n, d, dtype, 1);
            for (int64_t r = 0; r < n; ++r)
                quant_row(buf + r * d * es, d, dtype, q + (r0 + r) * d, scale + r0 + r);
        }
        free(buf);
    }
    return failed ? 2 : 0;
}

/* The GEMM's epilogue alone, over int32 sums acc [m, n] (row stride acc_stride) another GEMM
 * (oneDNN's, through torch._int_mm) computed: out as kiln_int8_gemm writes it. */
int kiln_int8_scale(const int32_t *acc, int64_t acc_stride, const float *a_scale,
                    const float *w_scale, const void *bias, int32_t bias_dtype, void *out,
                    int64_t out_stride, int64_t m, int64_t n, int32_t out_dtype,
                    int32_t num_threads) {
#pragma omp parallel for num_threads(num_threads) if (m >= 4)
    for (int64_t r = 0; r < m; ++r)
        scale_row(acc + r * acc_stride, 0, a_scale[r], w_scale, bias, bias_dtype,
                  (char *)out + r * out_stride * elem_size(out_dtype), n, out_dtype);
    return 0;
}

/* [sum a, sum b, sum c, sum d] of four vectors of int32 partial sums. */
static inline __m128i hsum4(__m512i a, __m512i b, __m512i c, __m512i d) {
    __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    __m512i s = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
    __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* out[r][0:4] = sum_k (w[j][k] + 128) * a[r][k] for MR rows a[r] and 4 weight rows w[j], 64
 * bytes of k a step (the last one masked). MR is a constant at each call: fully unrolled. */
static inline __attribute__((always_inline)) void micro(const int MR, const int8_t *const *a,
                                                        const int8_t *const *w, int64_t k,
                                                        int64_t ahead, int32_t *out,
                                                        int64_t out_stride) {
    __m512i acc[4][4];
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_si512();
    const __m512i offset = _mm512_set1_epi8((char)0x80);
    for (int64_t i = 0; i < k; i += 64) {
        const __mmask64 m = k - i >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (k - i)) - 1);
        __m512i wv[4], av[4];
        for (int j = 0; j < 4; ++j) {
            wv[j] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, w[j] + i), offset);
            /* a line PREFETCH_BYTES on, into L2: a decode step reads each weight once, from
             * memory, and the hardware prefetchers alone left it at half the DRAM bandwidth
             * (the next channels' line into L1, which this used to fetch, did not help) */
            _mm_prefetch((const char *)(w[j] + i + ahead), _MM_HINT_T1);
        }
        for (int r = 0; r < MR; ++r) av[r] = _mm512_maskz_loadu_epi8(m, a[r] + i);
        for (int r = 0; r < MR; ++r)
            for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], wv[j], av[r]);
    }
    for (int r = 0; r < MR; ++r)
        _mm_storeu_si128((__m128i *)(out + r * out_stride),
                         hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
}

/* out [m, n] (out_dtype, row stride out_stride) = float32(a @ w^T) * a_scale[r] * w_scale[c]
 * (+ bias[c]), with a int8 [m, k] (row stride a_stride), w int8 [n, k] (row stride w_stride),
 * a_scale [m] and w_scale [n] float32, bias [n] in bias_dtype or NULL. */
int kiln_int8_gemm(const int8_t *a, int64_t a_stride, const float *a_scale, const int8_t *w,
                   int64_t w_stride, const float *w_scale, const void *bias, int32_t bias_dtype,
                   void *out, int64_t out_stride, int64_t m, int64_t n, int64_t k,
                   int32_t out_dtype, int32_t num_threads) {
    if (m == 0 || n == 0) return 0;
    int32_t *sums = (int32_t *)malloc((size_t)m * sizeof(int32_t));
    if (!sums) return 2;
    const int64_t mb = (m + BLOCK_M - 1) / BLOCK_M, nb = (n + BLOCK_N - 1) / BLOCK_N;
    const int64_t rows_ahead = w_stride > 0 ? PREFETCH_BYTES / w_stride : 0;
    const int64_t ahead = (rows_ahead > 4 ? rows_ahead : 4) * w_stride;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        int32_t *tile = (int32_t *)malloc((size_t)BLOCK_M * BLOCK_N * sizeof(int32_t));
        if (!tile) failed = 1;
#pragma omp for
        for (int64_t r = 0; r < m; ++r) sums[r] = row_offset(a + r * a_stride, k);
#pragma omp for collapse(2) schedule(static)
        for (int64_t bi = 0; bi < mb; ++bi)
            for (int64_t bj = 0; bj < nb; ++bj) {
                if (!tile) continue;
                const int64_t r0 = bi * BLOCK_M, c0 = bj * BLOCK_N;
                const int64_t rows = m - r0 < BLOCK_M ? m - r0 : BLOCK_M;
                const int64_t cols = n - c0 < BLOCK_N ? n - c0 : BLOCK_N;
                for (int64_t j = 0; j < cols; j += 4) {
                    const int8_t *wr[4];  /* past the last channel: repeat it, not stored */
                    for (int t = 0; t < 4; ++t)
                        wr[t] = w + (c0 + (j + t < cols ? j + t : cols - 1)) * w_stride;
                    int64_t i = 0;
                    for (; i + 4 <= rows; i += 4) {
                        const int8_t *ar[4] = {a + (r0 + i) * a_stride, a + (r0 + i + 1) * a_stride,
                                               a + (r0 + i + 2) * a_stride,
                                               a + (r0 + i + 3) * a_stride};
                        micro(4, ar, wr, k, ahead, tile + i * BLOCK_N + j, BLOCK_N);
                    }
                    for (; i < rows; ++i) {
                        const int8_t *ar[1] = {a + (r0 + i) * a_stride};
                        micro(1, ar, wr, k, ahead, tile + i * BLOCK_N + j, BLOCK_N);
                    }
                }
                for (int64_t i = 0; i < rows; ++i)
                    scale_row(tile + i * BLOCK_N, sums[r0 + i], a_scale[r0 + i], w_scale + c0,
                              bias ? (const char *)bias + c0 * elem_size(bias_dtype) : NULL,
                              bias_dtype, (char *)out + ((r0 + i) * out_stride + c0) *
                              elem_size(out_dtype), cols, out_dtype);
            }
        free(tile);
    }
    free(sums);
    return failed ? 2 : 0;
}

#else /* no AVX512-VNNI: Python's supported() sees kiln_int8_isa() == 0 and never calls these */

int kiln_int8_isa(void) { return 0; }
int kiln_dynamic_int8_quant(const void *x, int64_t x_stride, int8_t *q, float *scale,
                            int64_t rows, int64_t k, int32_t dtype, int32_t num_threads) {
    return 4;
}
int kiln_rms_norm_int8_quant(const void *x, int64_t x_stride, const void *residual,
                             int64_t res_stride, void *residual_out, const void *weight, int8_t *q,
                             float *scale, int64_t rows, int32_t hidden, float eps, int32_t dtype,
                             int32_t num_threads) {
    return 4;
}
int kiln_silu_and_mul_int8_quant(const void *x, int64_t x_stride, int8_t *q, float *scale,
                                 int64_t rows, int32_t d, int32_t dtype, int32_t num_threads) {
    return 4;
}
int kiln_int8_gemm(const int8_t *a, int64_t a_stride, const float *a_scale, const int8_t *w,
                   int64_t w_stride, const float *w_scale, const void *bias, int32_t bias_dtype,
                   void *out, int64_t out_stride, int64_t m, int64_t n, int64_t k,
                   int32_t out_dtype, int32_t num_threads) {
    return 4;
}
int kiln_int8_scale(const int32_t *acc, int64_t acc_stride, const float *a_scale,
                    const float *w_scale, const void *bias, int32_t bias_dtype, void *out,
                    int64_t out_stride, int64_t m, int64_t n, int32_t out_dtype,
                    int32_t num_threads) {
    return 4;
}
#endif
