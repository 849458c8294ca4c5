/* Small-batch matmul on GGUF-quantized weights: out [m, n] = x [m, k] @ W^T, W in llama.cpp's
 * Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or Q6_K blocks, for the few rows of a decode step.
 *
 * There a linear layer is a pass over its weight, bound by memory bandwidth: a Q4_1 weight is
 * 0.75 bytes per value in the kernel's layout against 4 for float32, so reading the blocks and
 * widening them in registers beats streaming the dequantized float32 copy (up to a few tiles of
 * 8 rows, where the float32 GEMM's arithmetic wins).
 * - Q4_0, Q4_1, Q4_K, Q5_K and Q8_0 blocks take integer dot products against x cut into int8
 *   limbs (gguf_int_dot.h), within a few times float32's rounding for float32 x.
 * - Q6_K blocks are widened to their values exactly as gguf's dequantize computes them
 *   ((d * sc) * (q - 32)). float32 x multiplies them in float32; bfloat16 x multiplies them
 *   rounded to bfloat16, as the dequantized bfloat16 weight holds them, with float32
 *   accumulation (AVX512-BF16), as a bfloat16 GEMM does.
 * The weight is in the kernel's layout (gguf_blocks.h): a K-quant block of 256 values is 8
 * blocks of 32, so every loop reads 32-value blocks; Q6_K's in rows, [n, k / 32], the others
 * in groups of 16 rows. x, bias and out are in dtype (dtype.h).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "dtype.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
#include <immintrin.h>
#define KILN_GGUF_SIMD 1
#else
#define KILN_GGUF_SIMD 0
#endif
#if KILN_GGUF_SIMD && defined(__AVX512BF16__)
#define KILN_GGUF_BF16 1
#else
#define KILN_GGUF_BF16 0
#endif

#include "gguf_blocks.h"

#define MAX_ROWS 8 /* rows of x a register tile takes; more go through in tiles of 8 */

#if KILN_GGUF_SIMD
#include "gguf_int_dot.h"
#endif

/* 1 when the vector kernel is compiled in; the caller keeps float32 weights otherwise. */
int kiln_gguf_simd(void) { return KILN_GGUF_SIMD; }

/* 1 when bfloat16 x takes the bfloat16 dot products; else it is widened to float32 first. */
int kiln_gguf_bf16_dot(void) { return KILN_GGUF_BF16; }

/* gguf_blocks.h's sizes, for the Python side */
int kiln_gguf_block_bytes(int32_t qtype) { return gguf_block_bytes(qtype); }
int kiln_gguf_block_values(int32_t qtype) { return gguf_block_values(qtype); }
int kiln_gguf_kernel_block_bytes(int32_t qtype) { return gguf_kernel_block_bytes(qtype); }
/* Output rows a weight of `qtype` is held in groups of: GROUP_ROWS, or 1 (rows). */
int kiln_gguf_group_rows(int32_t qtype) { return is_grouped(qtype) ? GROUP_ROWS : 1; }

#if KILN_GGUF_SIMD
/* One converted Q6_K sub-block's 32 values (gguf_blocks.h), widened and scaled, a scale per 16:
 * lo = values 0-15, hi = values 16-31. */
static inline void load_block(const uint8_t *blk, __m512 *lo, __m512 *hi) {
    const __m128i q0 = _mm_loadu_si128((const __m128i *)(blk + 8));
    const __m128i q1 = _mm_loadu_si128((const __m128i *)(blk + 24));
    *lo = _mm512_mul_ps(_mm512_set1_ps(f32_at(blk)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)));
    *hi = _mm512_mul_ps(_mm512_set1_ps(f32_at(blk + 4)),
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)));
}

/* A decode step streams every weight from DRAM once, faster than the hardware prefetcher asks
 * for it: the loops ask for the block this many ahead (a hint; past the end it reads nothing).
 * The default model on 2 cores, one process, ms a step (its 120 linears / LM head): one row,
 * 16 ahead, 3.6 -> 3.45 / = (32: 3.7); 8 rows, 8 ahead 12.7 / 3.55, 48 ahead 11.5 / 2.8;
 * 2 rows, 48 ahead, 4.8 -> 4.6; bfloat16, 48 ahead, 8 rows 8.6 / 2.5 -> 8.1 / 2.1. */
#define PREFETCH_BLOCKS 48

/* Output rows [o0, o1) for M rows of float32 x; M is a compile-time constant at each call site,
 * so the M accumulators stay in registers. */
static inline __attribute__((always_inline)) void rows_f32(
        const float *x, const uint8_t *weight, int bb, const void *bias, void *out,
        const int M, int64_t o0, int64_t o1, int64_t n, int64_t k, int dtype) {
    const int64_t nb = k / QK, row_bytes = nb * bb;
    for (int64_t o = o0; o < o1; ++o) {
        const uint8_t *row = weight + o * row_bytes;
        /* Below 4 rows, two accumulators a row: a single chain of FMAs would wait on each one's
         * latency. From 4 rows on the rows' chains overlap, and 2 M accumulators spill. */
        __m512 acc[MAX_ROWS], acc2[MAX_ROWS];
        for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
        for (int r = 0; r < M && M < 4; ++r) acc2[r] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            __m512 lo, hi;
            _mm_prefetch((const char *)(row + (b + PREFETCH_BLOCKS) * bb), _MM_HINT_T0);
            load_block(row + b * bb, &lo, &hi);
            for (int r = 0; r < M; ++r) {
                const float *xr = x + r * k + b * QK;
                acc[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), acc[r]);
                if (M < 4)
                    acc2[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), acc2[r]);
                else
                    acc[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), acc[r]);
            }
        }
        const float bv = bias ? load_elem(bias, o, dtype) : 0.f;
        for (int r = 0; r < M; ++r) {
            const __m512 sum = M < 4 ? _mm512_add_ps(acc[r], acc2[r]) : acc[r];
            store_elem(out, r * n + o, _mm512_reduce_add_ps(sum) + bv, dtype);
        }
    }
}

/* rows_f32 for 8 rows of a wide x (k >= 1024), two output rows at a time: each load of x feeds
 * both. 8 rows of a 1024-wide x (32 KB) outgrow L1, and the loads of x become the limit:
 * int8 blocks (Q8_0 then), random [2048, 1024] / [2048, 2048] weights, 4.1 -> 3.9 / 6.6 -> 4.6
 * ns per 32 values (2 cores). Narrower x lost ([49152, 576]: 2.76 -> 2.87 ms), and so did 4
 * rows of 2048 (2.3 -> 3.2). rows_f32 takes an odd last row. */
static inline __attribute__((always_inline)) void rows_f32_pairs(
        const float *x, const uint8_t *weight, int bb, const void *bias, void *out,
        const int M, int64_t o0, int64_t o1, int64_t n, int64_t k, int dtype) {
    const int64_t nb = k / QK, row_bytes = nb * bb;
    int64_t o = o0;
    for (; o + 1 < o1; o += 2) {
        const uint8_t *row = weight + o * row_bytes, *row2 = row + row_bytes;
        __m512 acc[MAX_ROWS], acc2[MAX_ROWS]; /* output rows o and o + 1 */
        for (int r = 0; r < M; ++r) acc[r] = acc2[r] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            __m512 lo, hi, lo2, hi2;
            _mm_prefetch((const char *)(row + (b + PREFETCH_BLOCKS) * bb), _MM_HINT_T0);
            _mm_prefetch((const char *)(row2 + (b + PREFETCH_BLOCKS) * bb), _MM_HINT_T0);
            load_block(row + b * bb, &lo, &hi);
            load_block(row2 + b * bb, &lo2, &hi2);
            for (int r = 0; r < M; ++r) {
                const float *xr = x + r * k + b * QK;
                const __m512 x0 = _mm512_loadu_ps(xr), x1 = _mm512_loadu_ps(xr + 16);
                acc[r] = _mm512_fmadd_ps(hi, x1, _mm512_fmadd_ps(lo, x0, acc[r]));
                acc2[r] = _mm512_fmadd_ps(hi2, x1, _mm512_fmadd_ps(lo2, x0, acc2[r]));
            }
        }
        const float bv = bias ? load_elem(bias, o, dtype) : 0.f;
        const float bv2 = bias ? load_elem(bias, o + 1, dtype) : 0.f;
        for (int r = 0; r < M; ++r) {
            store_elem(out, r * n + o, _mm512_reduce_add_ps(acc[r]) + bv, dtype);
            store_elem(out, r * n + o + 1, _mm512_reduce_add_ps(acc2[r]) + bv2, dtype);
        }
    }
    if (o < o1) rows_f32(x, weight, bb, bias, out, M, o, o1, n, k, dtype);
}

#if KILN_GGUF_BF16
/* The same for bfloat16 x: the block's values rounded to bfloat16, pairs multiplied and summed
 * into float32 lanes; x and the weights share one value order, so the pairing is immaterial. */
static inline __attribute__((always_inline)) void rows_bf16(
        const uint16_t *x, const uint8_t *weight, int bb, const void *bias,
        void *out, const int M, int64_t o0, int64_t o1, int64_t n, int64_t k, int dtype) {
    const int64_t nb = k / QK, row_bytes = nb * bb;
    for (int64_t o = o0; o < o1; ++o) {
        const uint8_t *row = weight + o * row_bytes;
        /* Blocks in pairs, one accumulator each, for two chains of dot products. */
        __m512 acc[MAX_ROWS], acc2[MAX_ROWS];
        for (int r = 0; r < M; ++r) acc[r] = acc2[r] = _mm512_setzero_ps();
        int64_t b = 0;
        for (; b + 1 < nb; b += 2) {
            __m512 lo, hi, lo2, hi2;
            _mm_prefetch((const char *)(row + (b + PREFETCH_BLOCKS) * bb), _MM_HINT_T0);
            load_block(row + b * bb, &lo, &hi);
            load_block(row + (b + 1) * bb, &lo2, &hi2);
            const __m512bh w = _mm512_cvtne2ps_pbh(hi, lo); /* values 0-31 in order */
            const __m512bh w2 = _mm512_cvtne2ps_pbh(hi2, lo2);
            for (int r = 0; r < M; ++r) {
                const uint16_t *xr = x + r * k + b * QK;
                acc[r] = _mm512_dpbf16_ps(acc[r], w, (__m512bh)_mm512_loadu_si512(xr));
                acc2[r] = _mm512_dpbf16_ps(acc2[r], w2, (__m512bh)_mm512_loadu_si512(xr + QK));
            }
        }
        if (b < nb) {
            __m512 lo, hi;
            load_block(row + b * bb, &lo, &hi);
            const __m512bh w = _mm512_cvtne2ps_pbh(hi, lo);
            for (int r = 0; r < M; ++r)
                acc[r] = _mm512_dpbf16_ps(acc[r], w,
                                          (__m512bh)_mm512_loadu_si512(x + r * k + b * QK));
        }
        const float bv = bias ? load_elem(bias, o, dtype) : 0.f;
        for (int r = 0; r < M; ++r)
            store_elem(out, r * n + o,
                       _mm512_reduce_add_ps(_mm512_add_ps(acc[r], acc2[r])) + bv, dtype);
    }
}
#endif

/* Output rows [o0, o1) of a Q6_K weight; x in float32 when x_f32, else bfloat16; out and bias
 * in dtype. */
static void matmul_rows(const void *x, int x_f32, const uint8_t *weight, int bb,
                        const void *bias, void *out, int m, int64_t n, int64_t k, int dtype,
                        int64_t o0, int64_t o1) {
#define ROWS(M) case M: KERNEL(M); break;
#define CASES switch (m) { ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8) }
    if (x_f32) {
#define KERNEL(M)                                                                         \
    do {                                                                                  \
        if (M == 8 && k >= 1024)                                                          \
            rows_f32_pairs(x, weight, bb, bias, out, M, o0, o1, n, k, dtype);      \
        else                                                                              \
            rows_f32(x, weight, bb, bias, out, M, o0, o1, n, k, dtype);            \
    } while (0)
        CASES
#undef KERNEL
    }
#if KILN_GGUF_BF16
    else {
#define KERNEL(M) rows_bf16(x, weight, bb, bias, out, M, o0, o1, n, k, dtype)
        CASES
#undef KERNEL
    }
#endif
}

/* Groups [g0, g1) of a weight of `qtype` held in groups, for m rows of x in limbs (quantize_x):
 * 3 for float32 x, else 2. */
static void matmul_groups(const int8_t *xq, const float *dx, const float *sx, const int32_t *hs,
                          const int32_t *ls, int limbs, const uint8_t *weight, int qtype,
                          const void *bias, void *out, int m, int64_t n, int64_t k, int dtype,
                          int64_t g0, int64_t g1) {
    const int five = qtype == GGML_Q5_K;
#define GROUPS(M, FIVE, L) \
    group_rows(xq, dx, sx, weight, FIVE, bias, out, M, L, g0, g1, n, k, dtype)
#define KERNEL(M)                                                                         \
    do {                                                                                  \
        if (qtype == GGML_Q8_0 && limbs == 3)                                             \
            group_rows_q8(xq, dx, hs, ls, weight, bias, out, M, 3, g0, g1, n, k, dtype);  \
        else if (qtype == GGML_Q8_0)                                                      \
            group_rows_q8(xq, dx, hs, ls, weight, bias, out, M, 2, g0, g1, n, k, dtype);  \
        else if (five && limbs == 3)                                                      \
            GROUPS(M, 1, 3);                                                              \
        else if (five)                                                                    \
            GROUPS(M, 1, 2);                                                              \
        else if (limbs == 3)                                                              \
            GROUPS(M, 0, 3);                                                              \
        else                                                                              \
            GROUPS(M, 0, 2);                                                              \
    } while (0)
    CASES
#undef GROUPS
#undef KERNEL
#undef CASES
#undef ROWS
}
#endif


#if KILN_GGUF_SIMD
/* kiln_gguf_matmul for a weight held in groups: each thread cuts its share of x's rows into
 * limbs, then takes its groups for one tile of rows after another. */
static int grouped_matmul(const void *x, const uint8_t *weight, int32_t qtype, const void *bias,
                          void *out, int32_t m, int64_t n, int64_t k, int32_t dtype,
                          int32_t num_threads) {
    const int limbs = dtype == KILN_F32 ? 3 : 2;
    const int64_t nb = k / QK, ng = n / GROUP_ROWS;
    const size_t elem = dtype == KILN_F32 ? sizeof(float) : sizeof(uint16_t);
    int8_t *xq = malloc((size_t)m * (size_t)k * (size_t)limbs);
    /* per block of x: dx, sx (float), hs, ls (int32) */
    float *dx = malloc(4 * sizeof(float) * (size_t)m * (size_t)nb), *sx = dx + m * nb;
    int32_t *hs = (int32_t *)(sx + m * nb), *ls = hs + m * nb;
    if (!xq || !dx) {
        free(xq);
        free(dx);
        return 2;
    }
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t r0 = m * t / nt, r1 = m * (t + 1) / nt, i0 = r0 * nb;
        quantize_x((const char *)x + (size_t)(r0 * k) * elem, dtype, r1 - r0, k, limbs,
                   xq + r0 * k * limbs, dx + i0, sx + i0, hs + i0, ls + i0);
#pragma omp barrier
        const int64_t g0 = ng * t / nt, g1 = ng * (t + 1) / nt;
        for (int r = 0; r < m; r += MAX_ROWS)
            matmul_groups(xq + r * k * limbs, dx + r * nb, sx + r * nb, hs + r * nb, ls + r * nb,
                          limbs, weight, qtype, bias, (char *)out + (size_t)(r * n) * elem,
                          m - r < MAX_ROWS ? m - r : MAX_ROWS, n, k, dtype, g0, g1);
    }
    free(xq);
    free(dx);
    return 0;
}

/* kiln_gguf_matmul for a weight of blocks in rows (Q6_K): each thread takes its output rows for
 * one tile of x's rows after another. */
static int row_matmul(const void *x, const uint8_t *weight, int32_t qtype, const void *bias,
                      void *out, int32_t m, int64_t n, int64_t k, int32_t dtype,
                      int32_t num_threads) {
    /* Q6_K runs as the 32-value blocks its layout holds */
    const int bb = gguf_kernel_block_bytes(qtype) / (gguf_block_values(qtype) / QK);
    const void *xin = x;
    float *xf = NULL;
    /* bfloat16 x is widened once where the bfloat16 dot product is missing */
    if (dtype != KILN_F32 && !KILN_GGUF_BF16) {
        xf = malloc(sizeof(float) * (size_t)m * (size_t)k);
        if (!xf) return 2;
        for (int64_t i = 0; i < m * k; ++i) xf[i] = load_elem(x, i, dtype);
        xin = xf;
    }
    const int x_f32 = dtype == KILN_F32 || xf != NULL;
    /* a tile of rows starts r0 rows into x and out */
    const size_t x_elem = x_f32 ? sizeof(float) : sizeof(uint16_t);
    const size_t out_elem = dtype == KILN_F32 ? sizeof(float) : sizeof(uint16_t);
#pragma omp parallel num_threads(num_threads)
    {
        /* Static split of the output rows, as `omp for schedule(static)` would make. */
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t o0 = n * t / nt, o1 = n * (t + 1) / nt;
        for (int r0 = 0; r0 < m; r0 += MAX_ROWS)
            matmul_rows((const char *)xin + (size_t)r0 * (size_t)k * x_elem, x_f32, weight,
                        bb, bias, (char *)out + (size_t)r0 * (size_t)n * out_elem,
                        m - r0 < MAX_ROWS ? m - r0 : MAX_ROWS, n, k, dtype, o0, o1);
    }
    free(xf);
    return 0;
}
#endif

/* out [m, n] = x [m, k] @ W^T (+ bias [n]), W in the kernel's layout, m >= 1, k a multiple of
 * the type's block values (32, or 256 for K-quants), n a multiple of GROUP_ROWS for a weight
 * held in groups. 1 for arguments it cannot take, 2 when out of memory. Above MAX_ROWS rows, a
 * thread's share of the weight, read from DRAM for the first tile of rows, is then mostly in
 * its L2 for the next. */
int kiln_gguf_matmul(const void *x, const uint8_t *weight, int32_t qtype, const void *bias,
                     void *out, int32_t m, int64_t n, int64_t k, int32_t dtype,
                     int32_t num_threads) {
    const int vpb = gguf_block_values(qtype);
    if (!KILN_GGUF_SIMD || gguf_block_bytes(qtype) == 0 || m < 1 || k < vpb || k % vpb
            || (is_grouped(qtype) && n % GROUP_ROWS))
        return 1;
#if KILN_GGUF_SIMD
    if (is_grouped(qtype))
        return grouped_matmul(x, weight, qtype, bias, out, m, n, k, dtype, num_threads);
    return row_matmul(x, weight, qtype, bias, out, m, n, k, dtype, num_threads);
#else
    (void)x, (void)weight, (void)bias, (void)out, (void)n, (void)dtype, (void)num_threads;
    return 1;
#endif
}
