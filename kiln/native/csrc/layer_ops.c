/* Fused CPU kernels for the small per-layer ops an eager forward spends its time launching:
 * RMSNorm (with the residual add) and SiLU-and-mul; rotary embedding is rotary.c's. Each is one
 * pass over its rows instead of 5-15 torch ops. They round to the model dtype where Hugging Face's
 * torch code does, so bfloat16 results match it; under torch.compile the torch code runs instead
 * (Inductor fuses).
 *
 * dtype: 0 float32, 1 bfloat16. Row strides are in elements; columns are contiguous.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"
#include "kernels.h"

/* rms_norm keeps a row's values on the stack up to this many (every model's hidden size), on the
 * heap above: a row of 4M values on the stack overflowed it (SIGSEGV, not an error). */
#define STACK_ROW_VALUES 16384

/* Each dtype gets its own inlined loop (with the dtype known the loops vectorize; a runtime dtype
 * left them scalar). A row's values go through it in blocks, the last one padded or masked, so
 * that every value takes the same path (the same exp, its square summed in the same place)
 * whatever the row's length, position or alignment and however many rows the call has. The
 * fused int8 kernels (int8_ops.c) call these whole on chunks of rows into their own scratch, or
 * (their bfloat16 rows) run row_blocks.h's same passes, and must equal the unfused op
 * bit for bit: a vector expf and a scalar one differ in the last bit, so a scalar tail or a peel
 * for alignment would break that. */
#include "row_blocks.h"

#if KILN_ROW_BLOCKS_AVX512
/* One row: see kiln_silu_and_mul. */
KILN_INLINE void silu_and_mul_row(const void *x, void *out, int d, int dtype) {
    const int whole = d - d % KILN_BLOCK;
    for (int i = 0; i < whole; i += KILN_BLOCK)
        silu_and_mul_block(x, out, d, i, dtype, block_mask(KILN_BLOCK));
    if (whole < d) silu_and_mul_block(x, out, d, whole, dtype, block_mask(d % KILN_BLOCK));
}

#else
/* Portable: loads, stores and the rounding of sums (exact steps, however GCC vectorizes them) are
 * plain loops; what is not exact (the sum of squares, silu's expf and division) runs over padded
 * blocks of 16 values in fixed-length loops, which GCC vectorizes whole or not at all. */
#define KILN_BLOCK 16
/* silu_and_mul's values a pass (on the stack) */
#define KILN_CHUNK 512

KILN_INLINE void rms_norm_row(const void *x, const void *residual, void *residual_out,
                              const void *weight, void *out, float *buf, int hidden, float eps,
                              int dtype) {
    const int padded = (hidden + KILN_BLOCK - 1) / KILN_BLOCK * KILN_BLOCK;
    if (residual) {
        /* the row read whole first: residual_out may be residual */
        for (int i = 0; i < hidden; ++i)
            buf[i] = round_to(load_elem(x, i, dtype) + load_elem(residual, i, dtype), dtype);
        if (residual_out)
            for (int i = 0; i < hidden; ++i) store_elem(residual_out, i, buf[i], dtype);
    } else {
        for (int i = 0; i < hidden; ++i) buf[i] = load_elem(x, i, dtype);
    }
    for (int i = hidden; i < padded; ++i) buf[i] = 0.f;
    float sq[KILN_BLOCK] = {0};
    for (int i = 0; i < padded; i += KILN_BLOCK)
        for (int j = 0; j < KILN_BLOCK; ++j) sq[j] += buf[i + j] * buf[i + j];
    float total = 0.f;
    for (int j = 0; j < KILN_BLOCK; ++j) total += sq[j];
    /* in double: -ffast-math turns a float 1 / sqrtf into an rsqrt estimate (NaN for inf) */
    const float inv = (float)(1.0 / sqrt((double)(total / hidden + eps)));
    /* normed into buf, then times the weight, in two loops: in one, -ffast-math reassociated
     * float32's (x * inv) * w into (x * w) * inv, NaN (inf * 0) where x * w overflows and
     * torch's is 0 (a row whose squares overflow has inv 0) */
    for (int i = 0; i < hidden; ++i) buf[i] = round_to(buf[i] * inv, dtype);
    for (int i = 0; i < hidden; ++i)
        store_elem(out, i, buf[i] * load_elem(weight, i, dtype), dtype);
}

KILN_INLINE void silu_and_mul_row(const void *x, void *out, int d, int dtype) {
    for (int c = 0; c < d; c += KILN_CHUNK) {
        const int n = d - c < KILN_CHUNK ? d - c : KILN_CHUNK;
        const int padded = (n + KILN_BLOCK - 1) / KILN_BLOCK * KILN_BLOCK;
        float g[KILN_CHUNK] __attribute__((aligned(64))), u[KILN_CHUNK] __attribute__((aligned(64)));
        for (int j = 0; j < n; ++j) g[j] = load_elem(x, c + j, dtype);
        for (int j = 0; j < n; ++j) u[j] = load_elem(x, (int64_t)d + c + j, dtype);
        for (int j = n; j < padded; ++j) g[j] = u[j] = 0.f;
        for (int b = 0; b < padded; b += KILN_BLOCK) {
            /* Vectorized under -ffast-math the division is a reciprocal estimate, whose
             * refinement gives NaN for an infinite divisor: expf's argument stops short of
             * overflow (from there on the quotient is within a subnormal of torch's -0). */
#pragma omp simd
            for (int j = b; j < b + KILN_BLOCK; ++j)
                g[j] = round_to(g[j] / (1.f + expf(fminf(-g[j], 88.7f))), dtype) * u[j];
        }
        for (int j = 0; j < n; ++j) store_elem(out, c + j, g[j], dtype);
    }
}
#endif

/* out = weight * dtype(x32 * rsqrt(mean(x32^2) + eps)), and with a residual first
 * x = dtype(x + residual), written to residual_out (rows of `hidden`). residual/residual_out may
 * be NULL. out may be x and residual_out residual (in place): a row is read whole before out is
 * written, and residual_out is written where residual was just read. */
int kiln_rms_norm(const void *x, int64_t x_stride, const void *residual, int64_t res_stride,
                  void *residual_out, const void *weight, void *out, int64_t out_stride,
                  int64_t rows, int32_t hidden, float eps, int32_t dtype, int32_t num_threads) {
    const int64_t es = dtype == KILN_F32 ? 4 : 2;
    const int padded = (hidden + KILN_BLOCK - 1) / KILN_BLOCK * KILN_BLOCK; /* whole blocks */
    const int on_stack = padded <= STACK_ROW_VALUES;
    int failed = 0;
#pragma omp parallel for num_threads(num_threads) if (rows >= KILN_ROW_OPS_PARALLEL_MIN_ROWS) \
    reduction(| : failed)
    for (int64_t r = 0; r < rows; ++r) {
        float stack_buf[on_stack && padded > 0 ? padded : 1] __attribute__((aligned(64)));
        /* whole blocks of floats: a multiple of 64 bytes, as aligned_alloc wants */
        float *heap = on_stack ? NULL : (float *)aligned_alloc(64, (size_t)padded * sizeof(float));
        float *buf = on_stack ? stack_buf : heap;
        if (!buf) {
            failed = 1;
            continue;
        }
        const char *xr = (const char *)x + r * x_stride * es;
        const char *rr = residual ? (const char *)residual + r * res_stride * es : NULL;
        char *ro = residual_out ? (char *)residual_out + r * hidden * es : NULL;
        char *o = (char *)out + r * out_stride * es;
        if (dtype == KILN_F32)
            rms_norm_row(xr, rr, ro, weight, o, buf, hidden, eps, KILN_F32);
        else
            rms_norm_row(xr, rr, ro, weight, o, buf, hidden, eps, KILN_BF16);
        free(heap);
    }
    return failed ? 2 : 0;
}

/* out [rows, d] = dtype(silu(gate)) * up, from x [rows, 2d] = [gate | up]. */
int kiln_silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t rows, int32_t d,
                      int32_t dtype, int32_t num_threads) {
    const int64_t es = dtype == KILN_F32 ? 4 : 2;
#pragma omp parallel for num_threads(num_threads) if (rows >= KILN_ROW_OPS_PARALLEL_MIN_ROWS)
    for (int64_t r = 0; r < rows; ++r) {
        const char *xr = (const char *)x + r * x_stride * es;
        char *o = (char *)out + r * d * es;
        if (dtype == KILN_F32)
            silu_and_mul_row(xr, o, d, KILN_F32);
        else
            silu_and_mul_row(xr, o, d, KILN_BF16);
    }
    return 0;
}
