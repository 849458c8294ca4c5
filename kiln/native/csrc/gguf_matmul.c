/* Small-batch matmul on GGUF-quantized weights: out [m, n] = x [m, k] @ W^T, W in llama.cpp's
 * Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or Q6_K blocks, for the few rows of a decode step.
 *
 * There a linear layer is a pass over its weight, bound by memory bandwidth: a Q4_1 weight is
 * 0.75 bytes per value in the kernel's layout against 4 for float32, so reading the blocks and
 * widening them in registers beats streaming the dequantized float32 copy (up to a few tiles of
 * 8 rows, where the float32 GEMM's arithmetic wins). Values are exactly the blocks'
 * (d * q + m, d * (q - 8), d * q, (d * sc) * q - dmin * m, (d * sc) * (q - 32), rounded as
 * gguf's dequantize rounds them). float32 activations multiply them in float32; bfloat16
 * activations multiply them rounded to bfloat16, as the dequantized bfloat16 weight holds them,
 * with float32 accumulation (AVX512-BF16), as a bfloat16 GEMM does. One row on 4- and 5-bit
 * blocks is computed in float32 by linearity instead (one_row_lin), equal up to float32 rounding.
 * No activation quantization, unlike llama.cpp's integer dot products.
 * The weight is [n, k / block values] blocks, row-major, in the kernel's layout (gguf_blocks.h:
 * a K-quant block of 256 values is 8 blocks of 32, so every loop reads 32-value blocks). x, bias
 * and out are in dtype (dtype.h).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "dtype.h"

#if defined(__AVX512F__) && defined(__F16C__)
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

/* 1 when the vector kernel is compiled in; the caller keeps float32 weights otherwise. */
int kiln_gguf_simd(void) { return KILN_GGUF_SIMD; }

/* 1 when bfloat16 x takes the bfloat16 dot products; else it is widened to float32 first. */
int kiln_gguf_bf16_dot(void) { return KILN_GGUF_BF16; }

/* gguf_blocks.h's sizes, for the Python side */
int kiln_gguf_block_bytes(int32_t qtype) { return gguf_block_bytes(qtype); }
int kiln_gguf_block_values(int32_t qtype) { return gguf_block_values(qtype); }
int kiln_gguf_kernel_block_bytes(int32_t qtype) { return gguf_kernel_block_bytes(qtype); }

#if KILN_GGUF_SIMD
#define EXACT (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* One block's 32 values in the kernel's layout: lo = values 0-15, hi = values 16-31, as ggml
 * lays them out (low nibbles first). A 4-bit block has only 16 distinct values (a 5-bit one
 * 32): they are computed once into a table, exactly as dequantize does (d * q, then + m), and
 * each value's bits pick its entry. int8 blocks are widened and scaled. */
static inline void load_block(const uint8_t *blk, int qtype, __m512 *lo, __m512 *hi) {
    if (qtype == KERNEL_Q8X2) { /* a converted Q6_K sub-block: a scale per 16 int8 */
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(blk + 8));
        const __m128i q1 = _mm_loadu_si128((const __m128i *)(blk + 24));
        *lo = _mm512_mul_ps(_mm512_set1_ps(f32_at(blk)),
                            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)));
        *hi = _mm512_mul_ps(_mm512_set1_ps(f32_at(blk + 4)),
                            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)));
        return;
    }
    if (qtype == GGML_Q8_0) {
        const __m512 d = _mm512_set1_ps(half_at(blk));
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(blk + 2));
        const __m128i q1 = _mm_loadu_si128((const __m128i *)(blk + 18));
        *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)));
        *hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)));
        return;
    }
    /* A 4- or 5-bit block in the kernel's layout: float32 d, m, the nibbles (5 bits: then the
     * fifth bits). */
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    if (qtype == KERNEL_Q5) {
        /* 32 levels in two 16-entry tables; index bit 4 (the fifth bit) picks the table */
        const __m512 d = _mm512_set1_ps(f32_at(blk)), m = _mm512_set1_ps(f32_at(blk + 4));
        const __m512 low = _mm512_add_round_ps(_mm512_mul_round_ps(d, iota, EXACT), m, EXACT);
        const __m512 high = _mm512_add_round_ps(
            _mm512_mul_round_ps(d, _mm512_add_ps(iota, _mm512_set1_ps(16.f)), EXACT), m, EXACT);
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 8)));
        const __m512i sixteen = _mm512_set1_epi32(16);
        uint32_t bits;
        memcpy(&bits, blk + 24, sizeof bits);
        const __m512i i0 = _mm512_and_si512(bytes, _mm512_set1_epi32(0x0f));
        const __m512i i1 = _mm512_srli_epi32(bytes, 4);
        *lo = _mm512_permutex2var_ps(
            low, _mm512_mask_or_epi32(i0, (__mmask16)bits, i0, sixteen), high);
        *hi = _mm512_permutex2var_ps(
            low, _mm512_mask_or_epi32(i1, (__mmask16)(bits >> 16), i1, sixteen), high);
        return;
    }
    const __m512 d4 = _mm512_set1_ps(f32_at(blk));
    const uint8_t *nibbles = blk + 8;
    /* Rounding-mode forms so the compiler cannot fuse them into one FMA: dequantize rounds
     * d * q before adding m (Q4_1), and computes d * (q - 8) in one rounding (Q4_0). */
    const __m512 table = qtype == GGML_Q4_1
        ? _mm512_add_round_ps(_mm512_mul_round_ps(d4, iota, EXACT), _mm512_set1_ps(f32_at(blk + 4)),
                              EXACT)
        : _mm512_mul_ps(d4, _mm512_sub_ps(iota, _mm512_set1_ps(8.f)));
    /* Each byte widened to a 32-bit lane; the permute reads only an index's low 4 bits, so
     * the low nibble needs no mask and the high one a shift. */
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)nibbles));
    *lo = _mm512_permutexvar_ps(idx, table);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table);
}

/* A decode step streams every weight from DRAM once, faster than the hardware prefetcher asks
 * for it: the loops ask for the block this many ahead (a hint; past the end it reads nothing).
 * The default model on 2 cores, one process, ms a step (its 120 linears / LM head): one row,
 * 16 ahead, 3.6 -> 3.45 / = (32: 3.7); 8 rows, 8 ahead 12.7 / 3.55, 48 ahead 11.5 / 2.8;
 * 2 rows, 48 ahead, 4.8 -> 4.6; bfloat16, 48 ahead, 8 rows 8.6 / 2.5 -> 8.1 / 2.1. */
#define PREFETCH_BLOCKS 48
#define PREFETCH_ONE_ROW 16

/* Output rows [o0, o1) for one row of x (float32) on 4- or 5-bit blocks (`five`, a constant at
 * each call site), by linearity: a block's w . x = d (q . x) + m sum(x) (m = -8 d for Q4_0), the
 * nibbles converted as integers (a fifth bit adds 16 x) and sum(x) per block precomputed (xsum).
 * Equal to the values' dot product up to float32 rounding; a decode step's commonest case, and
 * there a table lookup per block costs more than the read. */
static inline __attribute__((always_inline)) void one_row_lin(
        const float *x, const float *xsum, const uint8_t *weight, void *out, const void *bias,
        int64_t o0, int64_t o1, int64_t k, int dtype, const int five) {
    const int64_t nb = k / QK, bb = five ? Q5_KERNEL_BYTES : Q4_KERNEL_BYTES;
    const __m512i low = _mm512_set1_epi32(0x0f);
    const __m512 sixteen = _mm512_set1_ps(16.f);
    for (int64_t o = o0; o < o1; ++o) {
        const uint8_t *row = weight + o * nb * bb;
        __m512 acc = _mm512_setzero_ps();
        float offset = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk = row + b * bb; /* d, m, nibbles (, fifth bits) */
            _mm_prefetch((const char *)(blk + PREFETCH_ONE_ROW * bb), _MM_HINT_T0);
            const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 8)));
            const __m512 x0 = _mm512_loadu_ps(x + b * QK), x1 = _mm512_loadu_ps(x + b * QK + 16);
            __m512 qx = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), x1,
                                        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, low)),
                                                      x0));
            if (five) { /* lanes whose value has its fifth bit: + 16 x */
                uint32_t bits;
                memcpy(&bits, blk + 24, sizeof bits);
                qx = _mm512_mask3_fmadd_ps(sixteen, x0, qx, (__mmask16)bits);
                qx = _mm512_mask3_fmadd_ps(sixteen, x1, qx, (__mmask16)(bits >> 16));
            }
            acc = _mm512_fmadd_ps(_mm512_set1_ps(f32_at(blk)), qx, acc);
            offset += f32_at(blk + 4) * xsum[b];
        }
        const float bv = bias ? load_elem(bias, o, dtype) : 0.f;
        store_elem(out, o, _mm512_reduce_add_ps(acc) + offset + bv, dtype);
    }
}

/* Output rows [o0, o1) for M rows of float32 x; M is a compile-time constant at each call site,
 * so the M accumulators stay in registers. */
static inline __attribute__((always_inline)) void rows_f32(
        const float *x, const uint8_t *weight, int qtype, int bb, const void *bias, void *out,
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
            load_block(row + b * bb, qtype, &lo, &hi);
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

/* rows_f32 for 4 or more rows, two output rows at a time: each load of x feeds both (int8
 * blocks only at 8 rows of a wide x, see matmul). At 8 rows the loads of x were a limit, beyond L1 for a 1536-wide x (48 KB).
 * The default model's 120 linears at 8 rows on 2 cores, in one process: 14.1 -> 13.0 ms
 * before prefetching. Fewer rows stay on rows_f32 (2: 4.7 -> 5.4 ms), and Q8_0 blocks unless
 * 8 rows of x outgrow L1: its [49152, 576] LM head lost (2.76 -> 2.87 ms), random [2048, 1024]
 * / [2048, 2048] weights gained (4.1 -> 3.9 / 6.6 -> 4.6 ns per 32 values), and at 4 rows of
 * 2048 lost (2.3 -> 3.2). The same operations per output as rows_f32's, which takes an odd
 * last row. */
static inline __attribute__((always_inline)) void rows_f32_pairs(
        const float *x, const uint8_t *weight, int qtype, int bb, const void *bias, void *out,
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
            load_block(row + b * bb, qtype, &lo, &hi);
            load_block(row2 + b * bb, qtype, &lo2, &hi2);
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
    if (o < o1) rows_f32(x, weight, qtype, bb, bias, out, M, o, o1, n, k, dtype);
}

#if KILN_GGUF_BF16
/* The same for bfloat16 x: the block's values rounded to bfloat16, pairs multiplied and summed
 * into float32 lanes; x and the weights share one value order, so the pairing is immaterial. */
static inline __attribute__((always_inline)) void rows_bf16(
        const uint16_t *x, const uint8_t *weight, int qtype, int bb, const void *bias,
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
            load_block(row + b * bb, qtype, &lo, &hi);
            load_block(row + (b + 1) * bb, qtype, &lo2, &hi2);
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
            load_block(row + b * bb, qtype, &lo, &hi);
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

/* Output rows [o0, o1); x in float32 when x_f32, else bfloat16; out and bias in dtype. */
static void matmul(const void *x, int x_f32, const uint8_t *weight, int qtype, int bb,
                   const void *bias, void *out, int m, int64_t n, int64_t k, int dtype,
                   int64_t o0, int64_t o1) {
    /* int8 blocks (Q8_0, converted Q6_K) take output pairs only where x outgrows L1 */
    const int int8 = qtype == GGML_Q8_0 || qtype == KERNEL_Q8X2;
#define ROWS(M) case M: KERNEL(M); break;
#define CASES switch (m) { ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8) }
    if (x_f32) {
#define KERNEL(M)                                                                         \
    do {                                                                                  \
        if (M >= 4 && (!int8 || (M == 8 && k >= 1024)))                                   \
            rows_f32_pairs(x, weight, qtype, bb, bias, out, M, o0, o1, n, k, dtype);      \
        else                                                                              \
            rows_f32(x, weight, qtype, bb, bias, out, M, o0, o1, n, k, dtype);            \
    } while (0)
        CASES
#undef KERNEL
    }
#if KILN_GGUF_BF16
    else {
#define KERNEL(M) rows_bf16(x, weight, qtype, bb, bias, out, M, o0, o1, n, k, dtype)
        CASES
#undef KERNEL
    }
#endif
#undef CASES
#undef ROWS
}
#endif


/* out [m, n] = x [m, k] @ W^T (+ bias [n]), W in the kernel's layout, m >= 1, k a multiple of
 * the type's block values (32, or 256 for K-quants). Above MAX_ROWS rows each thread takes its
 * output rows for one tile of x's rows after another: its share of the weight, read from DRAM
 * for the first tile, is then mostly in its L2 for the next. */
int kiln_gguf_matmul(const void *x, const uint8_t *weight, int32_t qtype, const void *bias,
                     void *out, int32_t m, int64_t n, int64_t k, int32_t dtype,
                     int32_t num_threads) {
    const int bb = gguf_kernel_block_bytes(qtype);
    const int vpb = gguf_block_values(qtype);
    if (!KILN_GGUF_SIMD || bb == 0 || m < 1 || k < vpb || k % vpb) return 1;
    /* K-quants run as the 32-value blocks their kernel layout holds */
    qtype = kernel_type(qtype);
    const int kbb = bb / (vpb / QK); /* bytes of one 32-value block */
#if KILN_GGUF_SIMD
    const void *xin = x;
    float *xf = NULL;
    const int one_row = m == 1 && (is_q4(qtype) || qtype == KERNEL_Q5);
    /* bfloat16 x is widened once where the float32 code takes it: without the bfloat16 dot
     * product, and for one_row_lin */
    if (dtype != KILN_F32 && (!KILN_GGUF_BF16 || one_row)) {
        xf = malloc(sizeof(float) * (size_t)m * (size_t)k);
        if (!xf) return 2;
        for (int64_t i = 0; i < m * k; ++i) xf[i] = load_elem(x, i, dtype);
        xin = xf;
    }
    const int x_f32 = dtype == KILN_F32 || xf != NULL;
    /* a tile of rows starts r0 rows into x and out */
    const size_t x_elem = x_f32 ? sizeof(float) : sizeof(uint16_t);
    const size_t out_elem = dtype == KILN_F32 ? sizeof(float) : sizeof(uint16_t);
    float *xsum = NULL; /* one row on 4- or 5-bit blocks: each block's sum of x */
    if (one_row) {
        xsum = malloc(sizeof(float) * (size_t)(k / QK));
        if (!xsum) {
            free(xf);
            return 2;
        }
        const float *xv = xin;
        for (int64_t b = 0; b < k / QK; ++b) {
            float sum = 0.f;
            for (int i = 0; i < QK; ++i) sum += xv[b * QK + i];
            xsum[b] = sum;
        }
    }
#pragma omp parallel num_threads(num_threads)
    {
        /* Static split of the output rows, as `omp for schedule(static)` would make. */
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t o0 = n * t / nt, o1 = n * (t + 1) / nt;
        if (xsum && qtype == KERNEL_Q5)
            one_row_lin(xin, xsum, weight, out, bias, o0, o1, k, dtype, 1);
        else if (xsum)
            one_row_lin(xin, xsum, weight, out, bias, o0, o1, k, dtype, 0);
        else
            for (int r0 = 0; r0 < m; r0 += MAX_ROWS)
                matmul((const char *)xin + (size_t)r0 * (size_t)k * x_elem, x_f32, weight,
                       qtype, kbb, bias, (char *)out + (size_t)r0 * (size_t)n * out_elem,
                       m - r0 < MAX_ROWS ? m - r0 : MAX_ROWS, n, k, dtype, o0, o1);
    }
    free(xsum);
    free(xf);
#endif
    return 0;
}
