/* dynamic_int8_quant(silu_and_mul(int8_scaled_mm(a, a weight in VNNI panels))) in one call: an
 * MLP's gate/up projection, its activation and the down projection's input quantization.
 *
 * From kiln_int8_gemm_silu_quant_min_rows() rows each thread takes blocks of rows through all
 * three steps (the GEMM on AMX-INT8 tiles where granted, else VNNI register tiles), the block's
 * [gate | up] values in its own scratch, which stays in its L2: the [M, 2d] projection, a prefill
 * chunk's largest activation, is never written to memory and read back. Fewer rows (a decode
 * step) run the GEMM over the whole matrix, its channels split among the threads, then the fused
 * SiLU + quant kernel: the unfused sequence. Every value is the one the unfused kernels give, since the same functions
 * compute it (a row's sums do not depend on which rows share its call).
 */
#include <stdint.h>
#include <stdlib.h>

#include "int8_simd.h"
#include "kernels.h"

/* Rows a thread takes through the three steps at a time: their [gate | up] scratch (384 KB for a
 * 135M model's 2 x 1536 channels in bfloat16) stays in L2 beside the weight's panels. */
#define BLOCK_ROWS 64
/* From this many rows blocks of rows pay: below it each thread's few blocks re-read the whole
 * weight, which the channel split shares among the threads. */
#define MIN_ROWS 256

#if KILN_INT8_SIMD

int kiln_int8_gemm_silu_quant_min_rows(void) { return MIN_ROWS; }

int kiln_int8_gemm_silu_quant(const int8_t *a, int64_t a_stride, const float *a_scale,
                              const uint8_t *panels, const float *w_scale, const void *bias,
                              int32_t bias_dtype, int8_t *q, float *scale, int64_t m, int64_t n,
                              int64_t k, int32_t dtype, int32_t num_threads) {
    if (n % 2 || k % 4 || k < 0) return 1;
    if (m == 0) return 0;
    const size_t es = elem_size(dtype);
    const int64_t d = n / 2, min_rows = kiln_int8_gemm_silu_quant_min_rows();
    if (!min_rows || m < min_rows) {
        void *h = malloc((size_t)(m * n) * es); /* [m, n] */
        if (!h) return 2;
        int rc = kiln_int8_gemm_packed(a, a_stride, a_scale, panels, w_scale, bias, bias_dtype, h,
                                       n, m, n, k, dtype, num_threads);
        if (!rc) rc = kiln_silu_and_mul_int8_quant(h, n, q, scale, m, (int32_t)d, dtype,
                                                   num_threads);
        free(h);
        return rc;
    }
    const int64_t blocks = (m + BLOCK_ROWS - 1) / BLOCK_ROWS;
    int rc = 0;
#pragma omp parallel num_threads(num_threads) reduction(max : rc)
    {
        int failed = 0; /* this thread's first error (rc's private copy starts at INT_MIN) */
        void *h = malloc((size_t)(BLOCK_ROWS * n) * es); /* [BLOCK_ROWS, n] */
        if (!h) failed = 2;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; ++b) {
            if (failed) continue;
            const int64_t r0 = b * BLOCK_ROWS, rows = m - r0 < BLOCK_ROWS ? m - r0 : BLOCK_ROWS;
            /* one thread's block: the packed GEMM picks AMX tiles or VNNI registers by rows */
            failed = kiln_int8_gemm_packed(a + r0 * a_stride, a_stride, a_scale + r0, panels,
                                           w_scale, bias, bias_dtype, h, n, rows, n, k, dtype, 1);
            if (!failed)
                failed = kiln_silu_and_mul_int8_quant(h, n, q + r0 * d, scale + r0, rows,
                                                      (int32_t)d, dtype, 1);
        }
        free(h);
        rc = failed;
    }
    return rc;
}

#else /* built for a CPU without AVX512-VNNI: the op is never chosen */

int kiln_int8_gemm_silu_quant_min_rows(void) { return 0; }

int kiln_int8_gemm_silu_quant(const int8_t *a, int64_t a_stride, const float *a_scale,
                              const uint8_t *panels, const float *w_scale, const void *bias,
                              int32_t bias_dtype, int8_t *q, float *scale, int64_t m, int64_t n,
                              int64_t k, int32_t dtype, int32_t num_threads) {
    return 4;
}
#endif
