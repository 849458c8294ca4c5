/* gguf_matmul.c's kernel: integer dot products (AVX512-VNNI) of x cut into int8 limbs
 * (gguf_limbs.h) against a weight's integers, made unsigned, 16 output rows per register.
 *
 * A 4- or 5-bit block's w . x = d (q . x) + m sum(x); a Q8_0 block's d (q . x); a Q6_K block's
 * a0 (q . x over values 0-15) + a1 (over 16-31), q - 32 its values. With x held in integers,
 * q . x is exact, and vpdpbusd does 64 of its products an instruction against a float32 FMA's
 * 16 (at the same rate here, one a cycle). Three limbs take 24 of them per 16 outputs, 32 values
 * and row of x, against the float32 FMA's 32, and no table lookups or widening. The default
 * model's 120 linear shapes (random Q4_1 weights, 2 cores, the float kernel it replaced / this
 * one's): float32 1.01-1.05x at 1 row (bound by memory), 1.30x at 2, 1.49-1.52x at 4,
 * 1.44-1.49x at 8, 1.47x at 16, 1.19x at 32; bfloat16 1.12x at 1, 1.28x at 4, 1.34x at 8, 1.43x
 * at 16. Its Q8_0 LM head [49152, 576]: 2.98 -> 2.16 ms at 8 rows.
 *
 * The limbs' dot products are summed in int32 lanes, ((q.h << 7) + q.l1) << 7 + q.l2: at most
 * 32 * 31 * 64 * 128^2 + ... < 2^31 for 5-bit q, and 16 * 63 * ... per half for Q6_K's q + 32.
 * Q8_0's could outgrow int32 (32 * 255 * ...): its first limb is summed apart from the others.
 * Each type's offset that made q unsigned (+ 128, + 32) comes off in integers, from x's limb
 * sums. A one-hot x yields a weight's value to the bit, rounded once as dequantize rounds it.
 *
 * The weight comes in groups of GROUP_ROWS output rows (gguf_layout.c). A group's 32-value
 * block holds its 16 rows' scales, float32 (d and m; d; a0 and a1), then their values, 4 per
 * row in each 64-byte vector: byte 4c + i of vector j is row c's value 4j + i, so vector j
 * meets x's dword j, broadcast. 4- and 5-bit values are packed two to a byte, vector j's low
 * nibbles values 4j + i and high ones 16 + 4j + i (vectors j and j + 4 once split), 5-bit
 * values' fifth bits after them, as 8 64-bit masks of vector j's bytes. */
#ifndef KILN_GGUF_INT_DOT_H
#define KILN_GGUF_INT_DOT_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "dtype.h"
#include "gguf_blocks.h"
#include "gguf_limbs.h"

/* Group blocks a loop asks for ahead of the one it reads: a decode step streams every weight
 * from DRAM once, faster than the hardware prefetcher asks for it. At 1-2 rows the loop is
 * quick enough that only asking further ahead, into L2, kept up with DRAM: random [2048, 2048]
 * Q4_K at 1 row, us, 130 (8 blocks ahead into L1) -> 112 (16 into L2; 110 the old float kernel).
 * From 3 rows on, 8 into L1 did better (the default model's linears at 8 rows 1.29-1.35x ->
 * 1.44-1.49x the old float kernel's speed). */
#define GROUP_PREFETCH_BLOCKS 8
#define GROUP_PREFETCH_L2_BLOCKS 16

enum { GROUP_Q4, GROUP_Q5, GROUP_Q8, GROUP_Q6 }; /* how a group holds its values */

/* How a weight of the file's `qtype` is held in groups. */
static inline int group_kind(int32_t qtype) {
    switch (qtype) {
        case GGML_Q5_K: return GROUP_Q5;
        case GGML_Q8_0: return GROUP_Q8;
        case GGML_Q6_K: return GROUP_Q6;
        default: return GROUP_Q4;
    }
}

/* out [M, o .. o + 16) = acc (row r's times 2^-shift[r], gguf_limbs.h) (+ bias) in dtype;
 * out's rows are n wide, and the last group's columns past n (the layout's zero rows) are not
 * written. */
static inline void store_group(const __m512 *acc, int M, const int32_t *shift, const void *bias,
                               void *out, int64_t o, int64_t n, int dtype) {
    const int cols = n - o < GROUP_ROWS ? (int)(n - o) : GROUP_ROWS;
    for (int r = 0; r < M; ++r) {
        float v[GROUP_ROWS];
        _mm512_storeu_ps(v, shift[r] ? times_pow2(acc[r], -shift[r]) : acc[r]);
        for (int c = 0; c < cols; ++c)
            store_elem(out, r * n + o + c, v[c] + (bias ? load_elem(bias, o + c, dtype) : 0.f),
                       dtype);
    }
}

/* Bytes of a group's 32-value block. */
static inline int64_t group_block_bytes(int kind) {
    const int bytes[] = {Q4_KERNEL_BYTES, Q5_KERNEL_BYTES, Q8_KERNEL_BYTES, Q6_KERNEL_BYTES};
    return GROUP_ROWS * bytes[kind];
}

/* Output rows [g0, g1) * GROUP_ROWS for M rows of x in limbs; kind, M and limbs are compile-time
 * constants at each call site, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void group_rows(
        const XLimbs *x, const uint8_t *weight, const int kind, const void *bias, void *out,
        const int M, const int limbs, int64_t g0, int64_t g1, int64_t n, int64_t k, int dtype) {
    const int64_t nb = k / QK, gbb = group_block_bytes(kind);
    const __m512i low = _mm512_set1_epi8(0x0f), sixteen = _mm512_set1_epi8(16);
    const __m512 first_unit = _mm512_set1_ps((float)(1 << (LIMB_SHIFT * (limbs - 1))));
    for (int64_t g = g0; g < g1; ++g) {
        const uint8_t *wg = weight + g * nb * gbb;
        __m512 acc[MAX_ROWS];
        for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk = wg + b * gbb;
            for (int64_t line = 0; line < gbb; line += 64) {
                if (M <= 2)
                    _mm_prefetch((const char *)(blk + GROUP_PREFETCH_L2_BLOCKS * gbb + line),
                                 _MM_HINT_T1);
                else
                    _mm_prefetch((const char *)(blk + GROUP_PREFETCH_BLOCKS * gbb + line),
                                 _MM_HINT_T0);
            }
            /* d and m; d; a0 and a1 */
            const __m512 s0 = _mm512_loadu_ps(blk), s1 = _mm512_loadu_ps(blk + 64);
            __m512i q[8]; /* q[j]: values 4j .. 4j + 3 of the 16 rows */
            if (kind == GROUP_Q4 || kind == GROUP_Q5) {
                for (int j = 0; j < 4; ++j) {
                    const __m512i v = _mm512_loadu_si512(blk + 128 + 64 * j);
                    q[j] = _mm512_and_si512(v, low);
                    q[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                }
            } else {
                for (int j = 0; j < 8; ++j)
                    q[j] = _mm512_loadu_si512(blk + (kind == GROUP_Q8 ? 64 : 128) + 64 * j);
            }
            if (kind == GROUP_Q5)
                for (int j = 0; j < 8; ++j) {
                    uint64_t bits;
                    memcpy(&bits, blk + 384 + 8 * j, sizeof bits);
                    q[j] = _mm512_mask_add_epi8(q[j], (__mmask64)bits, q[j], sixteen);
                }
            for (int r = 0; r < M; ++r) {
                const int64_t i = r * nb + b;
                const int32_t *xr = (const int32_t *)(x->q + i * QK * limbs);
                /* Two chains of dot products per limb, values 0-15 and 16-31: one chain of all
                 * 24 waited on each (8 rows, Q4_1: 1.14x the float32 kernel with one, 1.39x
                 * with one per limb, 1.47x with these six). */
                __m512i lo[3], hi[3];
                for (int l = 0; l < limbs; ++l) {
                    lo[l] = hi[l] = _mm512_setzero_si512();
                    for (int j = 0; j < 4; ++j) {
                        lo[l] = dot_add(lo[l], q[j], _mm512_set1_epi32(xr[8 * l + j]));
                        hi[l] = dot_add(hi[l], q[j + 4], _mm512_set1_epi32(xr[8 * l + j + 4]));
                    }
                }
                const __m512 unit = _mm512_mul_ps(s0, _mm512_set1_ps(x->dx[i])); /* exact */
                if (kind == GROUP_Q6) { /* each half ((h << 7) + l1) << 7 + l2, less 32 x */
                    __m512i dlo = lo[0], dhi = hi[0];
                    for (int l = 1; l < limbs; ++l) {
                        dlo = _mm512_add_epi32(_mm512_slli_epi32(dlo, LIMB_SHIFT), lo[l]);
                        dhi = _mm512_add_epi32(_mm512_slli_epi32(dhi, LIMB_SHIFT), hi[l]);
                    }
                    dlo = _mm512_sub_epi32(dlo, _mm512_set1_epi32(32 * x->half[2 * i]));
                    dhi = _mm512_sub_epi32(dhi, _mm512_set1_epi32(32 * x->half[2 * i + 1]));
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dlo), unit, acc[r]);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dhi),
                                             _mm512_mul_ps(s1, _mm512_set1_ps(x->dx[i])), acc[r]);
                } else if (kind == GROUP_Q8) { /* the first limb apart, each less 128 x */
                    __m512i first = _mm512_add_epi32(lo[0], hi[0]), rest = _mm512_setzero_si512();
                    for (int l = 1; l < limbs; ++l)
                        rest = _mm512_add_epi32(_mm512_slli_epi32(rest, LIMB_SHIFT),
                                                _mm512_add_epi32(lo[l], hi[l]));
                    first = _mm512_sub_epi32(first, _mm512_set1_epi32(128 * x->first[i]));
                    rest = _mm512_sub_epi32(rest, _mm512_set1_epi32(128 * x->rest[i]));
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(rest), unit, acc[r]);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(first),
                                             _mm512_mul_ps(unit, first_unit), acc[r]);
                } else { /* ((h << 7) + l1) << 7 + l2, then + m sum(x) */
                    __m512i dot = _mm512_add_epi32(lo[0], hi[0]);
                    for (int l = 1; l < limbs; ++l)
                        dot = _mm512_add_epi32(_mm512_slli_epi32(dot, LIMB_SHIFT),
                                               _mm512_add_epi32(lo[l], hi[l]));
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), unit, acc[r]);
                    acc[r] = _mm512_fmadd_ps(s1, _mm512_set1_ps(x->sx[i]), acc[r]);
                }
            }
        }
        store_group(acc, M, x->shift, bias, out, g * GROUP_ROWS, n, dtype);
    }
}

#endif
