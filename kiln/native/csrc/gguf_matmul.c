/* Small-batch matmul on GGUF-quantized weights: out [m, n] = x [m, k] @ W^T, W in llama.cpp's
 * Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or Q6_K blocks, for the few rows of a decode step.
 *
 * There a linear layer is a pass over its weight, bound by memory bandwidth: a Q4_1 weight is
 * 0.75 bytes per value in the kernel's layout against 4 for float32, so reading the blocks and
 * multiplying them in registers beats streaming the dequantized float32 copy, up to a few tiles
 * of 8 rows, where the float32 GEMM's arithmetic wins. The arithmetic is integer dot products
 * against x cut into int8 limbs (gguf_int_dot.h), within a few times float32's rounding for
 * float32 x. The weight is in the kernel's layout (gguf_blocks.h, made by gguf_layout.c): a
 * K-quant block of 256 values is 8 blocks of 32, in groups of 16 output rows. x, bias and out
 * are in dtype (dtype.h).
 */
#include <stdint.h>

#include <omp.h>

#include "dtype.h"
#include "gguf_blocks.h"
#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
#define KILN_GGUF_SIMD 1
#define MAX_ROWS 8 /* rows of x a register tile takes; more go through in tiles of 8 */
#include "gguf_int_dot.h"
#else
#define KILN_GGUF_SIMD 0
#endif

/* 1 when the vector kernel is compiled in; the caller keeps float32 weights otherwise. */
int kiln_gguf_simd(void) { return KILN_GGUF_SIMD; }

/* gguf_blocks.h's sizes, for the Python side */
int kiln_gguf_block_bytes(int32_t qtype) { return gguf_block_bytes(qtype); }
int kiln_gguf_block_values(int32_t qtype) { return gguf_block_values(qtype); }
int kiln_gguf_kernel_block_bytes(int32_t qtype) { return gguf_kernel_block_bytes(qtype); }
/* Output rows the layout holds a weight in groups of. */
int kiln_gguf_group_rows(void) { return GROUP_ROWS; }

#if KILN_GGUF_SIMD
/* Groups [g0, g1) of a weight held as `kind` (group_kind), for m rows of x in limbs: 3 for
 * float32 x, else 2. Every combination is its own instance of group_rows. */
static void matmul_groups(const XLimbs *x, int limbs, const uint8_t *weight, int kind,
                          const void *bias, void *out, int m, int64_t n, int64_t k, int dtype,
                          int64_t g0, int64_t g1) {
#define GROUPS(KIND, M, L) group_rows(x, weight, KIND, bias, out, M, L, g0, g1, n, k, dtype)
#define LIMBS(KIND, M) if (limbs == 3) GROUPS(KIND, M, 3); else GROUPS(KIND, M, 2);
#define KINDS(M)                                                                          \
    case M:                                                                               \
        switch (kind) {                                                                   \
            case GROUP_Q4: LIMBS(GROUP_Q4, M) break;                                      \
            case GROUP_Q5: LIMBS(GROUP_Q5, M) break;                                      \
            case GROUP_Q8: LIMBS(GROUP_Q8, M) break;                                      \
            default: LIMBS(GROUP_Q6, M) break;                                            \
        }                                                                                 \
        break;
    switch (m) { KINDS(1) KINDS(2) KINDS(3) KINDS(4) KINDS(5) KINDS(6) KINDS(7) KINDS(8) }
#undef KINDS
#undef LIMBS
#undef GROUPS
}

/* Each thread cuts its share of x's rows into limbs, then takes its groups for one tile of
 * rows after another: its share of the weight, read from DRAM for the first tile, is then
 * mostly in its L2 for the next. */
static int grouped_matmul(const void *x, const uint8_t *weight, int32_t qtype, const void *bias,
                          void *out, int32_t m, int64_t n, int64_t k, int32_t dtype,
                          int32_t limbs, int32_t num_threads) {
    const int kind = group_kind(qtype);
    const int64_t ng = (n + GROUP_ROWS - 1) / GROUP_ROWS; /* the last one padded with zeros */
    const size_t elem = dtype == KILN_F32 ? sizeof(float) : sizeof(uint16_t);
    XLimbs xl;
    if (!xlimbs_alloc(&xl, m, k, limbs)) return 2;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        quantize_x(x, dtype, m * t / nt, m * (t + 1) / nt, k, limbs, &xl);
#pragma omp barrier
        const int64_t g0 = ng * t / nt, g1 = ng * (t + 1) / nt;
        for (int r = 0; r < m; r += MAX_ROWS) {
            const XLimbs tile = xlimbs_from(&xl, r, k, limbs);
            matmul_groups(&tile, limbs, weight, kind, bias, (char *)out + (size_t)(r * n) * elem,
                          m - r < MAX_ROWS ? m - r : MAX_ROWS, n, k, dtype, g0, g1);
        }
    }
    xlimbs_free(&xl);
    return 0;
}
#endif

/* out [m, n] = x [m, k] @ W^T (+ bias [n]), W in the kernel's layout (its n rows padded to whole
 * groups of GROUP_ROWS), m >= 1, k a multiple of the type's block values (32, or 256 for
 * K-quants). float32 x is cut into f32_limbs limbs: 3 for float32 precision, 2 where torch's
 * float32 matmul precision allows less (bfloat16 x always takes 2). 1 for arguments it cannot
 * take, 2 when out of memory. */
int kiln_gguf_matmul(const void *x, const uint8_t *weight, int32_t qtype, const void *bias,
                     void *out, int32_t m, int64_t n, int64_t k, int32_t dtype,
                     int32_t f32_limbs, int32_t num_threads) {
    const int vpb = gguf_block_values(qtype);
    if (!KILN_GGUF_SIMD || gguf_block_bytes(qtype) == 0 || m < 1 || k < vpb || k % vpb
            || n < 1 || (f32_limbs != 2 && f32_limbs != 3))
        return 1;
#if KILN_GGUF_SIMD
    return grouped_matmul(x, weight, qtype, bias, out, m, n, k, dtype,
                          dtype == KILN_F32 ? f32_limbs : 2, num_threads);
#else
    (void)x, (void)weight, (void)bias, (void)out, (void)dtype, (void)num_threads;
    return 1;
#endif
}
