/* Small-batch matmul on GGUF-quantized weights: out [m, n] = x [m, k] @ W^T, W in llama.cpp's
 * Q4_0, Q4_1 or Q8_0 blocks, for the few rows of a decode step.
 *
 * There a linear layer is a pass over its weight, bound by memory bandwidth: a Q4_1 weight is
 * 0.625 bytes per value against 4 for float32, so reading the blocks and widening them in
 * registers beats streaming the dequantized float32 copy. Values are exactly the blocks'
 * (d * q + m, d * (q - 8), d * q, as gguf's dequantize computes them). float32 activations
 * multiply them in float32; bfloat16 activations multiply them rounded to bfloat16, as the
 * dequantized bfloat16 weight would hold them, with float32 accumulation (AVX512-BF16), as a
 * bfloat16 GEMM does. No activation quantization, unlike llama.cpp's integer dot products.
 * The weight is [n, k / 32] blocks, row-major; x, bias and out are in dtype (dtype.h).
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

#define MAX_ROWS 8
#define QK 32 /* values per block */

enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8 }; /* ggml's type ids */

/* 1 when the vector kernel is compiled in; the caller keeps float32 weights otherwise. */
int kiln_gguf_simd(void) { return KILN_GGUF_SIMD; }

/* 1 when bfloat16 x takes the bfloat16 dot products; else it is widened to float32 first. */
int kiln_gguf_bf16_dot(void) { return KILN_GGUF_BF16; }

int kiln_gguf_block_bytes(int32_t qtype) {
    switch (qtype) {
        case GGML_Q4_0: return 18; /* fp16 d, 16 bytes of nibbles */
        case GGML_Q4_1: return 20; /* fp16 d, fp16 m, 16 bytes of nibbles */
        case GGML_Q8_0: return 34; /* fp16 d, 32 int8 */
        default: return 0;
    }
}

#if KILN_GGUF_SIMD
#define EXACT (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* One block's 32 values: lo = values 0-15, hi = values 16-31, as ggml lays them out (low
 * nibbles first). A 4-bit block has only 16 distinct values: they are computed once into a
 * table, exactly as dequantize does (d * q, then + m), and each nibble picks its entry. */
static inline void load_block(const uint8_t *blk, int qtype, __m512 *lo, __m512 *hi) {
    const __m512 d = _mm512_set1_ps(half_at(blk));
    if (qtype == GGML_Q8_0) {
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(blk + 2));
        const __m128i q1 = _mm_loadu_si128((const __m128i *)(blk + 18));
        *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)));
        *hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)));
        return;
    }
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 table;
    const uint8_t *nibbles;
    if (qtype == GGML_Q4_1) {
        /* Rounding-mode forms so the compiler cannot fuse them into one FMA: dequantize
         * rounds d * q before adding m. */
        table = _mm512_add_round_ps(_mm512_mul_round_ps(d, iota, EXACT),
                                    _mm512_set1_ps(half_at(blk + 2)), EXACT);
        nibbles = blk + 4;
    } else {
        table = _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(8.f)));
        nibbles = blk + 2;
    }
    /* Each byte widened to a 32-bit lane; the permute reads only an index's low 4 bits, so
     * the low nibble needs no mask and the high one a shift. */
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)nibbles));
    *lo = _mm512_permutexvar_ps(idx, table);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table);
}

/* Output rows [o0, o1) for M rows of float32 x; M is a compile-time constant at each call
 * site, so the M accumulators stay in registers. */
static inline __attribute__((always_inline)) void rows_f32(
        const float *x, const uint8_t *weight, int qtype, int bb, const void *bias, void *out,
        const int M, int64_t o0, int64_t o1, int64_t n, int64_t k, int dtype) {
    const int64_t nb = k / QK;
    for (int64_t o = o0; o < o1; ++o) {
        const uint8_t *row = weight + o * nb * bb;
        /* Two accumulators a row: one chain of FMAs would wait on each one's latency. */
        __m512 acc[MAX_ROWS], acc2[MAX_ROWS];
        for (int r = 0; r < M; ++r) acc[r] = acc2[r] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            __m512 lo, hi;
            load_block(row + b * bb, qtype, &lo, &hi);
            for (int r = 0; r < M; ++r) {
                const float *xr = x + r * k + b * QK;
                acc[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), acc[r]);
                acc2[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), acc2[r]);
            }
        }
        const float bv = bias ? load_elem(bias, o, dtype) : 0.f;
        for (int r = 0; r < M; ++r)
            store_elem(out, r * n + o, _mm512_reduce_add_ps(_mm512_add_ps(acc[r], acc2[r])) + bv,
                       dtype);
    }
}

#if KILN_GGUF_BF16
/* The same for bfloat16 x: the block's values rounded to bfloat16, pairs multiplied and summed
 * into float32 lanes; x and the weights share one value order, so the pairing is immaterial. */
static inline __attribute__((always_inline)) void rows_bf16(
        const uint16_t *x, const uint8_t *weight, int qtype, int bb, const void *bias,
        void *out, const int M, int64_t o0, int64_t o1, int64_t n, int64_t k, int dtype) {
    const int64_t nb = k / QK;
    for (int64_t o = o0; o < o1; ++o) {
        const uint8_t *row = weight + o * nb * bb;
        /* Blocks in pairs, one accumulator each, for two chains of dot products. */
        __m512 acc[MAX_ROWS], acc2[MAX_ROWS];
        for (int r = 0; r < M; ++r) acc[r] = acc2[r] = _mm512_setzero_ps();
        int64_t b = 0;
        for (; b + 1 < nb; b += 2) {
            __m512 lo, hi, lo2, hi2;
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
#define ROWS(M) case M: KERNEL(M); break;
#define CASES switch (m) { ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8) }
    if (x_f32) {
#define KERNEL(M) rows_f32(x, weight, qtype, bb, bias, out, M, o0, o1, n, k, dtype)
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

/* out [m, n] = x [m, k] @ W^T (+ bias [n]), 1 <= m <= MAX_ROWS, k a multiple of 32. */
int kiln_gguf_matmul(const void *x, const uint8_t *weight, int32_t qtype, const void *bias,
                     void *out, int32_t m, int64_t n, int64_t k, int32_t dtype,
                     int32_t num_threads) {
    const int bb = kiln_gguf_block_bytes(qtype);
    if (!KILN_GGUF_SIMD || bb == 0 || m < 1 || m > MAX_ROWS || k < QK || k % QK) return 1;
#if KILN_GGUF_SIMD
    const void *xin = x;
    float *xf = NULL;
    if (dtype != KILN_F32 && !KILN_GGUF_BF16) { /* no bfloat16 dot product: widen x once */
        xf = malloc(sizeof(float) * (size_t)m * (size_t)k);
        if (!xf) return 2;
        for (int64_t i = 0; i < m * k; ++i) xf[i] = load_elem(x, i, dtype);
        xin = xf;
    }
    const int x_f32 = dtype == KILN_F32 || xf != NULL;
#pragma omp parallel num_threads(num_threads)
    {
        /* Static split of the output rows, as `omp for schedule(static)` would make. */
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        matmul(xin, x_f32, weight, qtype, bb, bias, out, m, n, k, dtype, n * t / nt,
               n * (t + 1) / nt);
    }
    free(xf);
#endif
    return 0;
}
