/* CPU kernels for the LayerNorm families' per-layer ops (StarCoder2, GPT-NeoX, Phi, Cohere):
 * LayerNorm (bias optional, residual add optional) and the non-gated MLPs' tanh-form GELU (the
 * erf form is torch's own: ops_layer_norm.cpp).
 *
 * Both compute in float32 and round once on store, as torch's CPU layer_norm and gelu do for
 * bfloat16 (and as HF's CohereLayerNorm does explicitly). Plain loops over a row: GCC
 * vectorizes them under -march=native -ffast-math (expf through libmvec where glibc has it),
 * so one source serves every CPU tier. dtype: dtype.h's codes; strides in elements.
 */
#include <math.h>
#include <stdint.h>

#include "dtype.h"
#include "kernels.h"

/* One row's LayerNorm. Statistics in two passes (mean, then the squared deviations: no
 * cancellation of E[x^2] - mean^2 for rows far from zero), in float32 as torch's. */
static inline __attribute__((always_inline)) void layer_norm_row(
    const void *x, const void *residual, void *residual_out, const void *weight,
    const void *bias, void *out, int hidden, float eps, int dtype) {
    const void *src = x;
    if (residual) {
        /* the sum rounds to the dtype once, as torch's x + residual, and the norm reads it */
        for (int i = 0; i < hidden; ++i)
            store_elem(residual_out, i, load_elem(x, i, dtype) + load_elem(residual, i, dtype),
                       dtype);
        src = residual_out;
    }
    float sum = 0.f;
    for (int i = 0; i < hidden; ++i) sum += load_elem(src, i, dtype);
    const float mean = sum / (float)hidden;
    float sq = 0.f;
    for (int i = 0; i < hidden; ++i) {
        const float d = load_elem(src, i, dtype) - mean;
        sq += d * d;
    }
    /* in double: -ffast-math turns a float 1 / sqrtf into an rsqrt estimate */
    const float rstd = (float)(1.0 / sqrt((double)(sq / (float)hidden) + (double)eps));
    if (bias) {
        for (int i = 0; i < hidden; ++i)
            store_elem(out, i,
                       (load_elem(src, i, dtype) - mean) * rstd * load_elem(weight, i, dtype) +
                           load_elem(bias, i, dtype),
                       dtype);
    } else {
        for (int i = 0; i < hidden; ++i)
            store_elem(out, i,
                       (load_elem(src, i, dtype) - mean) * rstd * load_elem(weight, i, dtype),
                       dtype);
    }
}

/* out [rows, hidden] = (s - mean(s)) / sqrt(var(s) + eps) * weight (+ bias), s = x or, with a
 * residual, dtype(x + residual), also written to residual_out (rows of `hidden`; it may be
 * residual). bias and residual may be NULL. */
int kiln_layer_norm(const void *x, int64_t x_stride, const void *residual, int64_t res_stride,
                    void *residual_out, const void *weight, const void *bias, void *out,
                    int64_t out_stride, int64_t rows, int32_t hidden, float eps, int32_t dtype,
                    int32_t num_threads) {
    if (hidden <= 0) return rows > 0 ? 1 : 0;
    const int64_t es = dtype == KILN_F32 ? 4 : 2;
#pragma omp parallel for num_threads(num_threads) if (rows >= KILN_ROW_OPS_PARALLEL_MIN_ROWS)
    for (int64_t r = 0; r < rows; ++r) {
        const char *xr = (const char *)x + r * x_stride * es;
        const char *rr = residual ? (const char *)residual + r * res_stride * es : NULL;
        char *ro = residual ? (char *)residual_out + r * hidden * es : NULL;
        char *o = (char *)out + r * out_stride * es;
        /* each dtype its own inlined loop: with it known the loops vectorize */
        if (dtype == KILN_F32)
            layer_norm_row(xr, rr, ro, weight, bias, o, hidden, eps, KILN_F32);
        else
            layer_norm_row(xr, rr, ro, weight, bias, o, hidden, eps, KILN_BF16);
    }
    return 0;
}

/* gelu(x) = x * Phi(x) in F.gelu's tanh form:
 *   x / (1 + e^-2u), u = sqrt(2 / pi) (x + 0.044715 x^3)   (= x / 2 * (1 + tanh u))
 * The exponent stops short of float32 overflow: under -ffast-math the vector division is a
 * reciprocal estimate, NaN for an infinite divisor (from there on the quotient is 0 within a
 * subnormal, as torch's). */
static inline __attribute__((always_inline)) void gelu_tanh_row(const void *x, void *out, int d,
                                                                int dtype) {
    for (int i = 0; i < d; ++i) {
        const float v = load_elem(x, i, dtype);
        const float u = 0.7978845608028654f * (v + 0.044715f * v * v * v);
        store_elem(out, i, v / (1.f + expf(fminf(-2.f * u, 88.7f))), dtype);
    }
}

/* out [rows, d] = gelu(x [rows, d], approximate="tanh"). */
int kiln_gelu_tanh(const void *x, int64_t x_stride, void *out, int64_t rows, int32_t d,
                   int32_t dtype, int32_t num_threads) {
    const int64_t es = dtype == KILN_F32 ? 4 : 2;
#pragma omp parallel for num_threads(num_threads) if (rows >= KILN_ROW_OPS_PARALLEL_MIN_ROWS)
    for (int64_t r = 0; r < rows; ++r) {
        const char *xr = (const char *)x + r * x_stride * es;
        char *o = (char *)out + r * (int64_t)d * es;
        if (dtype == KILN_F32) gelu_tanh_row(xr, o, d, KILN_F32);
        else gelu_tanh_row(xr, o, d, KILN_BF16);
    }
    return 0;
}
