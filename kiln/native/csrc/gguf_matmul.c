/* Small-batch matmul on GGUF-quantized weights: out [m, n] = x [m, k] @ W^T, W in llama.cpp's
 * Q4_0, Q4_1 or Q8_0 blocks, for the few rows of a decode step.
 *
 * There a linear layer is a pass over its weight, bound by memory bandwidth: a Q4_1 weight is
 * 0.625 bytes per value against 4 for float32, so reading the blocks and widening them in
 * registers beats streaming the dequantized float32 copy. Values are exactly the blocks'
 * (d * q + m, d * (q - 8), d * q, as gguf's dequantize computes them), activations stay float32
 * (no activation quantization, unlike llama.cpp's integer dot products), accumulation in float32.
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

#define MAX_ROWS 8
#define QK 32 /* values per block */

enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8 }; /* ggml's type ids */

/* 1 when the vector kernel is compiled in; the caller keeps float32 weights otherwise. */
int kiln_gguf_simd(void) { return KILN_GGUF_SIMD; }

int kiln_gguf_block_bytes(int32_t qtype) {
    switch (qtype) {
        case GGML_Q4_0: return 18; /* fp16 d, 16 bytes of nibbles */
        case GGML_Q4_1: return 20; /* fp16 d, fp16 m, 16 bytes of nibbles */
        case GGML_Q8_0: return 34; /* fp16 d, 32 int8 */
        default: return 0;
    }
}

#if KILN_GGUF_SIMD
/* One block's 32 values, d applied (the offset term is added separately): lo = values 0-15,
 * hi = values 16-31, as ggml lays them out (low nibbles first). */
static inline void load_block(const uint8_t *blk, int qtype, __m512 *lo, __m512 *hi,
                              float *offset) {
    uint16_t dh;
    memcpy(&dh, blk, 2);
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(dh));
    if (qtype == GGML_Q8_0) {
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(blk + 2));
        const __m128i q1 = _mm_loadu_si128((const __m128i *)(blk + 18));
        *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)));
        *hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)));
        *offset = 0.f;
        return;
    }
    const int q41 = qtype == GGML_Q4_1;
    const __m128i q = _mm_loadu_si128((const __m128i *)(blk + (q41 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i ql = _mm_and_si128(q, mask);
    const __m128i qh = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
    *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(ql)));
    *hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(qh)));
    if (q41) {
        uint16_t mh;
        memcpy(&mh, blk + 2, 2);
        *offset = _cvtsh_ss(mh);
    } else {
        *offset = -8.f * _cvtsh_ss(dh);
    }
}

/* Output rows [o0, o1) for M rows of x; M is a compile-time constant at each call site, so the
 * M accumulators stay in registers. */
static inline __attribute__((always_inline)) void rows_range(
        const float *xs, const float *xsum, const uint8_t *weight, int qtype, int bb,
        const void *bias, void *out, const int M, int64_t o0, int64_t o1, int64_t n, int64_t k,
        int dtype) {
    const int64_t nb = k / QK;
    for (int64_t o = o0; o < o1; ++o) {
        const uint8_t *row = weight + o * nb * bb;
        __m512 acc[MAX_ROWS];
        float offs[MAX_ROWS];
        for (int r = 0; r < M; ++r) {
            acc[r] = _mm512_setzero_ps();
            offs[r] = 0.f; /* the blocks' offset (m, or -8 d) times the x block's sum */
        }
        for (int64_t b = 0; b < nb; ++b) {
            __m512 lo, hi;
            float offset;
            load_block(row + b * bb, qtype, &lo, &hi, &offset);
            for (int r = 0; r < M; ++r) {
                const float *xr = xs + r * k + b * QK;
                acc[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), acc[r]);
                acc[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), acc[r]);
                offs[r] += offset * xsum[r * nb + b];
            }
        }
        const float bv = bias ? load_elem(bias, o, dtype) : 0.f;
        for (int r = 0; r < M; ++r) {
            float off = offs[r];
            store_elem(out, r * n + o, _mm512_reduce_add_ps(acc[r]) + off + bv, dtype);
        }
    }
}
#endif

/* out [m, n] = x [m, k] @ W^T (+ bias [n]), 1 <= m <= MAX_ROWS, k a multiple of 32. */
int kiln_gguf_matmul(const void *x, const uint8_t *weight, int32_t qtype, const void *bias,
                     void *out, int32_t m, int64_t n, int64_t k, int32_t dtype,
                     int32_t num_threads) {
    const int bb = kiln_gguf_block_bytes(qtype);
    if (!KILN_GGUF_SIMD || bb == 0 || m < 1 || m > MAX_ROWS || k < QK || k % QK) return 1;
#if KILN_GGUF_SIMD
    const int64_t nb = k / QK;
    float *xs = malloc(sizeof(float) * (size_t)m * (size_t)(k + nb)); /* [m, k] + [m, nb] */
    if (!xs) return 2;
    float *xsum = xs + (size_t)m * (size_t)k; /* [m, nb]: each row's sum over each block */
    for (int64_t i = 0; i < m * k; ++i) xs[i] = load_elem(x, i, dtype);
    for (int r = 0; r < m; ++r)
        for (int64_t b = 0; b < nb; ++b) {
            float s = 0.f;
            for (int i = 0; i < QK; ++i) s += xs[r * k + b * QK + i];
            xsum[r * nb + b] = s;
        }
#pragma omp parallel num_threads(num_threads)
    {
        /* Static split of the output rows, as `omp for schedule(static)` would make. */
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t o0 = n * t / nt, o1 = n * (t + 1) / nt;
        switch (m) {
#define ROWS(M) case M: rows_range(xs, xsum, weight, qtype, bb, bias, out, M, o0, o1, n, k, dtype); break;
            ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
        }
    }
    free(xs);
#endif
    return 0;
}
