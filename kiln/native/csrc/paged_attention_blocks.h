/* The decode kernel's AVX-512 path: a query token against its keys one cache block (up to 16
 * keys) at a time, with the softmax kept online, so each K and V row is read once, in one pass. */
#ifndef KILN_PAGED_ATTENTION_BLOCKS_H
#define KILN_PAGED_ATTENTION_BLOCKS_H

#include <math.h>
#include <stdint.h>

#include "bf16_simd.h"
#include "dtype.h"
#include "fp8_simd.h"
#include "paged_attention_rows.h"

/* Keys a chunk holds at most: one vector of scores per query head. */
#define CHUNK_KEYS 16
/* Floats per query head of the decode kernel's scores buffer that attend_blocks needs at least:
 * a chunk's probabilities, its rescale factor, the sums of e^x by lane. */
#define CHUNK_SCRATCH (2 * CHUNK_KEYS + 1)
/* How far (in e-folds) a score may pass the running maximum before it is moved: e^8 ~ 3000, far
 * inside float32's range for any sum. */
#define LAZY_MAX 8.f

#if KILN_ATTN_SIMD
#include "paged_attention_pv.h"
#include "simd_exp.h"

/* Keys ahead whose K and V rows are asked for while a chunk is computed (into L2), over a 16- or
 * 32-bit cache; over fp8, whose rows are half as long, twice as many (measured: 32 took 1-4%
 * longer than the two-pass kernel at 32 x 2048 keys out of L3, 64 about as long or less). The K
 * rows are asked for among the dot products, the V rows among the softmax rows: all of them among
 * the dot products, now shorter, came in bursts that took up to 20% longer over caches out of L3
 * (docs/measurements.md). */
#define CHUNK_AHEAD 32

/* The byte offsets of keys [s, s + n)'s rows (from head offset head_off) into at, -1 past
 * n_keys: a chunk's keys lie in at most two blocks, so no division per key. */
static inline void chunk_rows(int64_t *at, const int32_t *blocks, int block_size, int s, int n,
                              int n_keys, int64_t slot_stride, int64_t head_off, int elem) {
    int b = s / block_size, in = s % block_size;
    for (int j = 0; j < n; ++j) {
        at[j] = s + j < n_keys
                    ? (((int64_t)blocks[b] * block_size + in) * slot_stride + head_off) * elem
                    : -1;
        if (++in == block_size) in = 0, ++b;
    }
}

/* Asks for the row (`bytes`) at byte offset at of a cache (none for -1) into L2. */
static inline void prefetch_row(const void *cache, int64_t at, int64_t bytes) {
    if (at < 0) return;
    for (int64_t x = 0; x < bytes; x += 64) __builtin_prefetch((const char *)cache + at + x, 0, 2);
}

/* o [rows, w] (row stride hd) = o * alpha[r] (nothing where `first`) + sum over the chunk's n keys
 * of p [rows, CHUNK_KEYS] (j) * value row j's w values at element offset `off` + j * slot_stride.
 * `rows` query heads share that kv head, so each value row is read once per tile; w <= 128.
 * `paired` (a bfloat16 or e4m3 cache, w a multiple of 32): each 32 values as bfloat16 widen to
 * float32 in two registers, their even and odd dims (a shift, a mask: half load16's work), so o
 * holds each 32 in that order (unpair_rows puts them back). */
static inline __attribute__((always_inline)) void pv_chunk(
    const float *p, const float *alpha, const void *v_cache, int64_t off, int64_t slot_stride,
    int n, int dtype, const void *tab, float *o, int first, int paired, const int rows,
    const int w, const int hd) {
    __m512 out[4][8];
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < w / 16; ++c)
            out[r][c] = first ? _mm512_setzero_ps()
                              : _mm512_mul_ps(_mm512_loadu_ps(o + (int64_t)r * hd + 16 * c),
                                              _mm512_set1_ps(alpha[r]));
#define KILN_PV_PAIRS(LOAD)                                                                  \
    for (int j = 0; j < n; ++j, off += slot_stride)                                          \
        for (int c = 0; c < w / 32; ++c) {                                                   \
            const __m512i x = LOAD;                                                          \
            const __m512 even = bf16_even(x), odd = bf16_odd(x);                             \
            for (int r = 0; r < rows; ++r) {                                                 \
                const __m512 pr = _mm512_set1_ps(p[r * CHUNK_KEYS + j]);                     \
                out[r][2 * c] = _mm512_fmadd_ps(pr, even, out[r][2 * c]);                    \
                out[r][2 * c + 1] = _mm512_fmadd_ps(pr, odd, out[r][2 * c + 1]);             \
            }                                                                                \
        }
    if (paired && dtype == KILN_BF16) {
        KILN_PV_PAIRS(_mm512_loadu_si512((const uint16_t *)v_cache + off + 32 * c))
#if KILN_FP8_SIMD
    } else if (paired) {
        KILN_PV_PAIRS(fp8x32_bf16((const uint8_t *)v_cache + off + 32 * c, (const Fp8Tab *)tab))
#endif
    } else {
        for (int j = 0; j < n; ++j, off += slot_stride)
            for (int c = 0; c < w / 16; ++c) {
                const __m512 v = load16(v_cache, off + 16 * c, dtype);
                for (int r = 0; r < rows; ++r)
                    out[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * CHUNK_KEYS + j]), v,
                                                out[r][c]);
            }
    }
#undef KILN_PV_PAIRS
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < w / 16; ++c)
            _mm512_storeu_ps(o + (int64_t)r * hd + 16 * c, out[r][c]);
}

/* Each 32 values of the rows of o [rows, hd] from pv_chunk's paired order (16 even dims, then 16
 * odd) back into dim order. */
static inline void unpair_rows(float *o, int rows, const int hd) {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    for (int64_t i = 0; i < (int64_t)rows * hd; i += 32) {
        const __m512 even = _mm512_loadu_ps(o + i), odd = _mm512_loadu_ps(o + i + 16);
        _mm512_storeu_ps(o + i, _mm512_permutex2var_ps(even, lo, odd));
        _mm512_storeu_ps(o + i + 16, _mm512_permutex2var_ps(even, hi, odd));
    }
}

/* The scores of the chunk's keys from slot0 on (n <= CHUNK_KEYS, in one block) into p [rows,
 * CHUNK_KEYS], asking for the K rows of the keys at ahead[0..CHUNK_KEYS) on the way: with
 * bf16_dot from the query rows in pair_query's form qx [rows, 2 * hd], up to DOT_TILE query
 * heads of a kv head at a time; else four keys at a time (the last four repeat the chunk's last
 * key where n is not a multiple of 4; their lanes are never read). Other arguments as
 * attend_blocks'. */
static inline __attribute__((always_inline)) void chunk_scores(
    const float *qs, const uint16_t *qx, float scale, const void *k_cache, int64_t slot0, int n,
    int h0, int nh_kv, int64_t slot_stride, int group, int dtype, int bf16_dot, uint16_t *kb,
    const void *tab, float *p, const int64_t *ahead, int64_t bytes, const int hd) {
    (void)kb, (void)tab;
    const int calls = nh_kv * group;
    int asked = 0; /* the prefetches go among the dot products: in one burst they stalled */
    if (bf16_dot) {
        for (int h = 0; h < nh_kv; ++h) {
            const int64_t row = (int64_t)h * group, off = slot0 * slot_stride + (h0 + h) * hd;
            const uint16_t *k = (const uint16_t *)k_cache;
            int64_t at = off, stride = slot_stride;
#if KILN_FP8_SIMD
            if (dtype != KILN_BF16) { /* the chunk's rows of this head as bfloat16, once */
                for (int j = 0; j < n; ++j)
                    for (int d = 0; d < hd; d += 32)
                        _mm512_storeu_si512(
                            kb + j * hd + d,
                            fp8x32_bf16((const uint8_t *)k_cache + off + j * slot_stride + d,
                                        (const Fp8Tab *)tab));
                k = kb, at = 0, stride = hd;
            }
#endif
            for (int g = 0; g < group; g += DOT_TILE) {
                const int t = group - g < DOT_TILE ? group - g : DOT_TILE;
                const int upto = (int)((row + g + t) * CHUNK_KEYS / calls);
                for (; asked < upto; ++asked) prefetch_row(k_cache, ahead[asked], bytes);
                const uint16_t *q = qx + (row + g) * 2 * hd;
                float *pr = p + (row + g) * CHUNK_KEYS;
                switch (t) { /* constant tile sizes, so the sums stay in registers */
                    case 3: dots16_bf16(q, k, at, stride, n, scale, pr, 3, hd); break;
                    case 2: dots16_bf16(q, k, at, stride, n, scale, pr, 2, hd); break;
                    default: dots16_bf16(q, k, at, stride, n, scale, pr, 1, hd);
                }
            }
        }
        return;
    }
    for (int j = 0; j < n; j += 4) {
        for (int i = 0; i < 4; ++i) prefetch_row(k_cache, ahead[j + i], bytes);
        int64_t off[4];
        for (int i = 0; i < 4; ++i)
            off[i] = (slot0 + (j + i < n ? j + i : n - 1)) * slot_stride + (int64_t)h0 * hd;
        for (int h = 0; h < nh_kv; ++h, off[0] += hd, off[1] += hd, off[2] += hd, off[3] += hd)
            for (int g = 0; g < group; ++g)
                _mm_storeu_ps(p + (int64_t)(h * group + g) * CHUNK_KEYS + j,
                              dot4(qs + (int64_t)(h * group + g) * hd, k_cache, off, dtype, hd));
    }
    (void)asked;
}

/* attend_token's AVX-512 path (same arguments and results; hd a multiple of 16), in chunks of
 * CHUNK_KEYS keys within a block: their scores, the online softmax (the outputs and sums so far
 * rescaled by e^(old max - new max) when a chunk raises a row's maximum), then their values (for
 * bfloat16 queries over a bfloat16 or fp8 cache, on VDPBF16PS: paged_attention_pv.h). The
 * scores buffer holds rows * (CHUNK_KEYS + 1) floats: a chunk's probabilities, then the rows'
 * rescale factors; buf (8 + rows) * hd: 16 bfloat16 key rows, then the query rows in
 * pair_query's form. (Two passes, all scores then all values, read the values a second time, out
 * of L2 or L3, once per kv head.) */
static inline __attribute__((always_inline)) void attend_blocks(
    const float *qs, const uint16_t *qb, float scale, const void *k_cache, const void *v_cache,
    const int32_t *blocks, int block_size, int n_keys, int h0, int nh_kv, int64_t slot_stride,
    int group, int dtype, float *p, float *acc, float *buf, float *denom, int k0, float *mx,
    float softcap, const int hd) {
    const int rows = nh_kv * group, elem = elem_size(dtype);
    const int64_t head_off = (int64_t)h0 * hd, bytes = (int64_t)nh_kv * hd * elem;
    const int bf16_dot = qb && kiln_paged_attention_bf16_dot(dtype, hd);
    uint16_t *qx = (uint16_t *)(buf + 8 * hd);
    if (bf16_dot)
        for (int r = 0; r < rows; ++r)
            pair_query(qb + (int64_t)r * hd, qx + (int64_t)r * 2 * hd, hd);
    float *alpha = p + rows * CHUNK_KEYS, *lane_sums = alpha + rows;
#if KILN_FP8_SIMD
    const Fp8Tab tab_regs = fp8_tab(dtype);
    const void *tab = &tab_regs;
#else
    const void *tab = NULL;
#endif
    const int tile = hd <= 64 ? 4 : 2; /* query heads whose outputs fit the registers */
    /* not e5m2, whose load16 (an fp16's top byte) is cheaper than the table (measured) */
    const int paired =
        hd % 32 == 0 && (dtype == KILN_BF16 || (KILN_FP8_SIMD && dtype == KILN_FP8E4M3));
    const int lead = elem == 1 ? 2 * CHUNK_AHEAD : CHUNK_AHEAD;
    int64_t ahead[2 * CHUNK_AHEAD > CHUNK_KEYS ? 2 * CHUNK_AHEAD : CHUNK_KEYS];
    chunk_rows(ahead, blocks, block_size, k0, lead, n_keys, slot_stride, head_off, elem);
    for (int j = 0; j < lead; ++j)
        prefetch_row(k_cache, ahead[j], bytes), prefetch_row(v_cache, ahead[j], bytes);
    for (int s = k0, first = 1; s < n_keys; first = 0) {
        const int in = s % block_size, left = n_keys - s;
        int n = block_size - in < CHUNK_KEYS ? block_size - in : CHUNK_KEYS;
        n = n < left ? n : left;
        for (int j = 0; j < CHUNK_KEYS; ++j) ahead[j] = -1;
        chunk_rows(ahead, blocks, block_size, s + lead, n, n_keys, slot_stride, head_off, elem);
        const int64_t slot0 = (int64_t)blocks[s / block_size] * block_size + in;
        chunk_scores(qs, qx, scale, k_cache, slot0, n, h0, nh_kv, slot_stride, group, dtype,
                     bf16_dot, (uint16_t *)buf, tab, p, ahead, bytes, hd);
        const __mmask16 live = (__mmask16)((1u << n) - 1);
        for (int r = 0, asked = 0; r < rows; ++r) {
            for (const int upto = (r + 1) * CHUNK_KEYS / rows; asked < upto; ++asked)
                prefetch_row(v_cache, ahead[asked], bytes);
            float *pr = p + r * CHUNK_KEYS;
            if (softcap > 0.f) /* Gemma-2's soft cap of the scaled scores */
                for (int j = 0; j < n; ++j) pr[j] = softcap * tanhf(pr[j] / softcap);
            const __m512 x = _mm512_maskz_loadu_ps(live, pr);
            __m512 sums = first ? _mm512_setzero_ps() : _mm512_loadu_ps(lane_sums + r * 16);
            alpha[r] = 1.f;
            /* A lazy maximum: moved only for a score LAZY_MAX above it (rarely after the first
             * chunks), so most chunks need no reduction for it, no e^x of it, no rescale. */
            if (first || _mm512_mask_cmp_ps_mask(live, x, _mm512_set1_ps(mx[r] + LAZY_MAX),
                                                 _CMP_GT_OQ)) {
                const float top = _mm512_mask_reduce_max_ps(live, x);
                alpha[r] = first ? 0.f : expf(mx[r] - top);
                sums = _mm512_mul_ps(sums, _mm512_set1_ps(alpha[r]));
                mx[r] = top;
            }
            __m512 e = _mm512_maskz_mov_ps(
                live, kiln_exp512(_mm512_sub_ps(x, _mm512_set1_ps(mx[r]))));
            /* kiln_exp512 takes NaN to 0: a NaN key's score stays NaN, as the output must */
            e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
            if (bf16_dot) /* the weights p . v takes, as bfloat16 (the sums keep float32's) */
                round_weights(e, pr);
            else
                _mm512_storeu_ps(pr, e);
            _mm512_storeu_ps(lane_sums + r * 16, _mm512_add_ps(sums, e));
        }
        for (int h = 0; h < nh_kv; ++h)
            for (int g = 0; g < group; g += tile) {
                const int r = h * group + g, t = group - g < tile ? group - g : tile;
                for (int c = 0; c < hd; c += 128) { /* wider heads by column slices */
                    const int64_t off = slot0 * slot_stride + (int64_t)(h0 + h) * hd + c;
                    const float *pr = p + r * CHUNK_KEYS;
                    float *o = acc + (int64_t)r * hd + c;
                    const int w = hd - c < 128 ? hd - c : 128;
#define KILN_PV(T)                                                                       \
    if (bf16_dot)                                                                        \
        pv_chunk_bf16(pr, alpha + r, v_cache, off, slot_stride, n, dtype, tab, o, first, T, w, \
                      hd);                                                               \
    else                                                                                 \
        pv_chunk(pr, alpha + r, v_cache, off, slot_stride, n, dtype, tab, o, first, paired, T, \
                 w, hd)
                    switch (t) { /* constant tile sizes, so the outputs stay in registers */
                        case 4: KILN_PV(4); break;
                        case 3: KILN_PV(3); break;
                        case 2: KILN_PV(2); break;
                        default: KILN_PV(1);
                    }
#undef KILN_PV
                }
            }
        s += n;
    }
    for (int r = 0; r < rows; ++r)
        denom[r] = _mm512_reduce_add_ps(_mm512_loadu_ps(lane_sums + r * 16));
    if (bf16_dot)
        unpermute_rows(acc, rows, hd);
    else if (paired)
        unpair_rows(acc, rows, hd);
}
#endif

#endif
