/* Skinny matmul for CPU decode steps: out [m, n] = x [m, k] @ weight[n, k]^T for a few rows m.
 *
 * With one to four rows a linear layer is a pass over its weight, bound by memory bandwidth;
 * streaming each weight row once and dotting it with every x row reads the weights at close to
 * the machine's bandwidth, where a GEMM library tuned for larger m does not.
 * x, weight, bias and out are in dtype (0 float32, 1 bfloat16); accumulation in float32, as
 * oneDNN does. x's few rows are widened to float32 once, here rather than in torch, whose
 * conversion op costs more per call than this whole kernel's bookkeeping.
 */
#include <stdint.h>
#include <stdlib.h>

#include "dtype.h"
#include "kernels.h"

#define MAX_ROWS 4

static inline __attribute__((always_inline)) void dot_rows(const float *xs, int m, int64_t k,
                                                           const void *w, int64_t off, int dtype,
                                                           float *acc) {
    for (int r = 0; r < m; ++r) acc[r] = 0.f;
    if (dtype == KILN_F32) {
        const float *wr = (const float *)w + off;
        for (int r = 0; r < m; ++r) {
            const float *xr = xs + r * k;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t i = 0; i < k; ++i) s += xr[i] * wr[i];
            acc[r] = s;
        }
    } else {
        const uint16_t *wr = (const uint16_t *)w + off;
        for (int r = 0; r < m; ++r) {
            const float *xr = xs + r * k;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t i = 0; i < k; ++i) s += xr[i] * bf16_to_f32(wr[i]);
            acc[r] = s;
        }
    }
}

/* out [m, n] (contiguous) = x [m, k] (contiguous) @ weight [n, k]^T (+ bias [n]). */
int kiln_gemv(const void *x, const void *weight, const void *bias, void *out, int32_t m,
              int64_t n, int64_t k, int32_t dtype, int32_t num_threads) {
    if (m < 1 || m > MAX_ROWS || k < 1) return 1;
    float *xs = (float *)malloc((size_t)m * (size_t)k * sizeof(float)); /* [m, k] */
    if (!xs) return 2;
    for (int64_t i = 0; i < m * k; ++i) xs[i] = load_elem(x, i, dtype);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t o = 0; o < n; ++o) {
        float acc[MAX_ROWS];
        dot_rows(xs, m, k, weight, o * k, dtype, acc);
        const float b = bias ? load_elem(bias, o, dtype) : 0.f;
        for (int r = 0; r < m; ++r) store_elem(out, r * n + o, acc[r] + b, dtype);
    }
    free(xs);
    return 0;
}
