/* The SIMD tiles of the prefill attention kernel (prefill_attention.c): scores and P.V for up to
 * 3 row groups at once, each row group being 16 query tokens of one head, one token per lane.
 *
 * Lanes are tokens so that the online softmax is vertical (max, exp and sums across a key block
 * are plain vector ops, no reductions) and so that K and V are read as broadcasts straight from
 * their cache rows: K needs no packing, and float32 V none either. bfloat16 V is packed in pairs
 * of keys (what _mm512_dpbf16_ps reduces over), once per key block for every row group.
 *
 * Layouts, per row group (`rg_*` floats or words apart):
 *   qp   float32: [hd][16] (scale folded in); bfloat16: [hd / 2][16] words, a token's
 *        (q[2d], q[2d+1]) per lane
 *   s    [SBK][16] float32 scores, then probabilities
 *   pp   bfloat16 probabilities: [SBK / 2][16] words, (p[2j], p[2j+1]) per lane; room for two
 *        key blocks' (prefill_attention.c holds a block's for the next one's P.V pass)
 *   o    [hd][16] float32 unnormalised outputs
 *   vpk  bfloat16 V of a key block: [SBK / 2][hd] words, (v[2j][c], v[2j+1][c])
 * Key rows kp[j] / vp[j] point into the cache (padding keys at a zero row). */
#ifndef KILN_PREFILL_TILES_H
#define KILN_PREFILL_TILES_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "simd_exp.h" /* libmvec's expf took a third of the kernel's time */
#define KILN_PREFILL_F32_SIMD 1
#else
#define KILN_PREFILL_F32_SIMD 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define KILN_PREFILL_BF16_SIMD 1
#else
#define KILN_PREFILL_BF16_SIMD 0
#endif

#define PF_BK 32   /* keys per block of the AMX tiles and the scalar path */
#define PF_SBK 64  /* keys per block of the AVX512 tiles: at 32 their per-block softmax set-up
                    * and P.V accumulator loads made the kernel 5% slower (4 x 512 tokens) */
#define PF_ROWS (PF_SBK > PF_BK ? PF_SBK : PF_BK) /* the scratch's keys, for either */
#define PF_KEYS 8  /* keys per score tile */
#define PF_DIMS 8  /* output dims per P.V tile */
#define PF_INLINE static inline __attribute__((always_inline))

static inline int32_t pf_word(const void *p) { /* an unaligned 32-bit load */
    int32_t w;
    memcpy(&w, p, sizeof w);
    return w;
}

#if KILN_PREFILL_F32_SIMD
/* r[0..15] (16 rows of 16 32-bit words) transposed in place: rounds swapping the off-diagonal
 * blocks of rows 8, 4, 2, 1 apart (row i, bit s of i clear, takes row i + s's lanes l - s into
 * its lanes with bit s set; row i + s row i's lanes l + s into those with it clear). */
static inline void pf_transpose16(__m512i r[16]) {
    static const int32_t lo[4][16] = {
        {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
        {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
        {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
        {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}};
    static const int32_t hi[4][16] = {
        {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
        {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
        {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
        {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}};
    /* spelled out: as a loop, GCC kept r in memory */
    __m512i pa, pb, a;
#define PF_SWAP(i, j)                                     \
    a = r[i], r[i] = _mm512_permutex2var_epi32(a, pa, r[j]), \
    r[j] = _mm512_permutex2var_epi32(a, pb, r[j])
    pa = _mm512_loadu_si512(lo[0]), pb = _mm512_loadu_si512(hi[0]);
    PF_SWAP(0, 8);
    PF_SWAP(1, 9);
    PF_SWAP(2, 10);
    PF_SWAP(3, 11);
    PF_SWAP(4, 12);
    PF_SWAP(5, 13);
    PF_SWAP(6, 14);
    PF_SWAP(7, 15);
    pa = _mm512_loadu_si512(lo[1]), pb = _mm512_loadu_si512(hi[1]);
    PF_SWAP(0, 4);
    PF_SWAP(1, 5);
    PF_SWAP(2, 6);
    PF_SWAP(3, 7);
    PF_SWAP(8, 12);
    PF_SWAP(9, 13);
    PF_SWAP(10, 14);
    PF_SWAP(11, 15);
    pa = _mm512_loadu_si512(lo[2]), pb = _mm512_loadu_si512(hi[2]);
    PF_SWAP(0, 2);
    PF_SWAP(1, 3);
    PF_SWAP(4, 6);
    PF_SWAP(5, 7);
    PF_SWAP(8, 10);
    PF_SWAP(9, 11);
    PF_SWAP(12, 14);
    PF_SWAP(13, 15);
    pa = _mm512_loadu_si512(lo[3]), pb = _mm512_loadu_si512(hi[3]);
    PF_SWAP(0, 1);
    PF_SWAP(2, 3);
    PF_SWAP(4, 5);
    PF_SWAP(6, 7);
    PF_SWAP(8, 9);
    PF_SWAP(10, 11);
    PF_SWAP(12, 13);
    PF_SWAP(14, 15);
#undef PF_SWAP
}

/* s[r][j] = qp[r] . k[j] for PF_KEYS keys from kp and R row groups. */
PF_INLINE void qk_f32(const float *qp, int64_t rg_q, const float *const *kp, int hd, float *s,
                      int64_t rg_s, const int R) {
    __m512 acc[3][PF_KEYS];
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < PF_KEYS; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int d = 0; d < hd; ++d) {
        __m512 q[3];
        for (int r = 0; r < R; ++r) q[r] = _mm512_loadu_ps(qp + r * rg_q + d * 16);
        for (int j = 0; j < PF_KEYS; ++j) {
            const __m512 k = _mm512_set1_ps(kp[j][d]);
            for (int r = 0; r < R; ++r) acc[r][j] = _mm512_fmadd_ps(q[r], k, acc[r][j]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < PF_KEYS; ++j) _mm512_storeu_ps(s + r * rg_s + j * 16, acc[r][j]);
}

/* o[r][c0 .. c0 + PF_DIMS) = alpha[r] (1 where NULL) * o[r][...] + sum over the block's keys j
 * of s[r][j] * v[j][c]. */
PF_INLINE void pv_f32(const float *s, int64_t rg_s, const float *const *vp, int nk, int c0,
                      float *o, int64_t rg_o, const float *alpha, const int R) {
    __m512 acc[3][PF_DIMS];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < PF_DIMS; ++c) acc[r][c] = _mm512_loadu_ps(o + r * rg_o + (c0 + c) * 16);
    if (alpha) /* the softmax's rescale, folded into the accumulators' loads */
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < PF_DIMS; ++c)
                acc[r][c] = _mm512_mul_ps(acc[r][c], _mm512_loadu_ps(alpha + 16 * r));
    for (int j = 0; j < nk; ++j) {
        __m512 p[3];
        for (int r = 0; r < R; ++r) p[r] = _mm512_loadu_ps(s + r * rg_s + j * 16);
        for (int c = 0; c < PF_DIMS; ++c) {
            const __m512 v = _mm512_set1_ps(vp[j][c0 + c]);
            for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(p[r], v, acc[r][c]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < PF_DIMS; ++c) _mm512_storeu_ps(o + r * rg_o + (c0 + c) * 16, acc[r][c]);
}
#endif

#if KILN_PREFILL_BF16_SIMD
/* As qk_f32, bfloat16 pairs (hd even): one dpbf16 covers two dims. mx[r] (16 floats a row
 * group): each lane's running maximum of the scores, taken from the accumulators, so that the
 * softmax need not read a block's scores twice (1-2% of the kernel at 4 x 512). */
PF_INLINE void qk_bf16(const int32_t *qp, int64_t rg_q, const uint16_t *const *kp, int hd,
                       float *s, int64_t rg_s, float *mx, const int R) {
    __m512 acc[3][PF_KEYS];
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < PF_KEYS; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int d = 0; d < hd / 2; ++d) {
        __m512bh q[3];
        for (int r = 0; r < R; ++r) q[r] = (__m512bh)_mm512_loadu_si512(qp + r * rg_q + d * 16);
        for (int j = 0; j < PF_KEYS; ++j) {
            const __m512bh k = (__m512bh)_mm512_set1_epi32(pf_word(kp[j] + 2 * d));
            for (int r = 0; r < R; ++r) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], q[r], k);
        }
    }
    for (int r = 0; r < R; ++r) {
        __m512 m = _mm512_loadu_ps(mx + 16 * r);
        for (int j = 0; j < PF_KEYS; ++j) {
            _mm512_storeu_ps(s + r * rg_s + j * 16, acc[r][j]);
            m = _mm512_max_ps(m, acc[r][j]);
        }
        _mm512_storeu_ps(mx + 16 * r, m);
    }
}

/* As pv_f32 over key pairs: pp's probability pairs against vpk's value pairs; where two key
 * blocks' pairs come at once, the second's from `split` on, alpha2 (1 where NULL) is the
 * rescale between them (the same operations, in the same order, as one block a call). */
PF_INLINE void pv_bf16(const int32_t *pp, int64_t rg_p, const int32_t *vpk, int hd, int pairs,
                       int split, int c0, float *o, int64_t rg_o, const float *alpha,
                       const float *alpha2, const int R) {
    __m512 acc[3][PF_DIMS];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < PF_DIMS; ++c) acc[r][c] = _mm512_loadu_ps(o + r * rg_o + (c0 + c) * 16);
    if (alpha) /* the softmax's rescale, folded into the accumulators' loads */
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < PF_DIMS; ++c)
                acc[r][c] = _mm512_mul_ps(acc[r][c], _mm512_loadu_ps(alpha + 16 * r));
    for (int j = 0; j < pairs; ++j) {
        if (j == split && alpha2)
            for (int r = 0; r < R; ++r)
                for (int c = 0; c < PF_DIMS; ++c)
                    acc[r][c] = _mm512_mul_ps(acc[r][c], _mm512_loadu_ps(alpha2 + 16 * r));
        __m512bh p[3];
        for (int r = 0; r < R; ++r) p[r] = (__m512bh)_mm512_loadu_si512(pp + r * rg_p + j * 16);
        for (int c = 0; c < PF_DIMS; ++c) {
            const __m512bh v = (__m512bh)_mm512_set1_epi32(vpk[j * hd + c0 + c]);
            for (int r = 0; r < R; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], p[r], v);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < PF_DIMS; ++c) _mm512_storeu_ps(o + r * rg_o + (c0 + c) * 16, acc[r][c]);
}

/* A pp row (prefill_tiles.h's layout) from the probabilities of keys 2j (p0) and 2j + 1 (p1):
 * rounded to bfloat16 (as SDPA rounds them before its P.V), word 2i p0's lane i, 2i + 1 p1's. */
static inline __m512i pf_pair_words(__m512 p0, __m512 p1) {
    const __m512i lanes = _mm512_setr_epi32(0x100000, 0x110001, 0x120002, 0x130003, 0x140004,
                                            0x150005, 0x160006, 0x170007, 0x180008, 0x190009,
                                            0x1a000a, 0x1b000b, 0x1c000c, 0x1d000d, 0x1e000e,
                                            0x1f000f);
    return _mm512_permutexvar_epi16(lanes, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
}
#endif

#endif
