/* What the prefill attention kernel's paths share (prefill_attention.c's scalar and AVX512 tiles,
 * prefill_amx.c's AMX tiles): a work unit, the call's arguments, a thread's scratch buffers. */
#ifndef KILN_PREFILL_UNIT_H
#define KILN_PREFILL_UNIT_H

#include <math.h>
#include <stdint.h>

#include "dtype.h"
#include "fp8_simd.h"

#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

#define MASKED (-1e30f) /* a masked score: finite, since the library builds with -ffast-math */

typedef struct {
    int req, kv_head, t0, nt; /* query rows [t0, t0 + nt) of request req */
    int64_t gathered; /* where its keys' gathered rows start in Call.gather, or -1 (none) */
    int64_t task0;    /* its (request, kv head)'s first key block's word in Call.gather_state */
} Unit;

typedef struct { /* what every unit of a call shares */
    const void *q, *k_cache, *v_cache;
    void *out;
    int64_t q_stride, out_stride, slot_stride, bt_stride;
    const int32_t *block_table, *query_start, *seq_lens;
    int block_size, hd, group, tb, dtype, elem; /* elem: bytes of a cache element */
    int kv_dtype; /* the cache's elements: dtype, or fp8 (dequantized a key block at a time) */
    float scale;   /* the scores' (an fp8 cache's k_scale folded in) */
    float v_scale; /* an fp8 cache's: the outputs' factor (1 else) */
    int window;    /* > 0: a query sees only the last `window` keys, its own included */
    float softcap; /* > 0: scaled scores become softcap * tanh(score / softcap) */
    uint16_t *gather; /* keys gathered once a call (prefill_gather.h), or NULL */
    int *gather_state; /* per gathered key block: 0 not yet, 1 under way, 2 done */
} Call;

typedef struct { /* one thread's buffers; layouts in prefill_tiles.h (prefill_amx.c's its own) */
    float *qp, *s, *o, *m, *l, *alpha, *buf; /* alpha: the softmax's rescale factors */
    float *bm; /* the AVX512-BF16 score tiles' maximum of a key block, per row group */
    int32_t *pp, *vpk;
    void *kt; /* the AMX path's K tiles of a key block */
    void *kv; /* an fp8 cache's key block, K then V rows, dequantized to dtype (2 * PF_ROWS * hd) */
    const void **kp, **vp;
    void *zero; /* a zero key/value row, standing in for the keys past a block's end */
} Scratch;

/* Where key `key` of the unit's request sits for its kv head (elements into a cache half). */
static inline int64_t key_offset(const Call *c, const int32_t *blocks, int key, int kv_head) {
    const int64_t slot = (int64_t)blocks[key / c->block_size] * c->block_size + key % c->block_size;
    return slot * c->slot_stride + (int64_t)kv_head * c->hd;
}

/* The first key a query at position `pos` sees: 0, or the start of its sliding window. */
static inline int first_key(const Call *c, int pos) {
    return c->window > 0 && pos + 1 > c->window ? pos + 1 - c->window : 0;
}

/* n scaled scores soft-capped in place (Gemma-2's attention logit soft-capping). */
static inline void soft_cap(const Call *c, float *s, int n) {
    if (c->softcap > 0.f)
        for (int i = 0; i < n; ++i) s[i] = c->softcap * tanhf(s[i] / c->softcap);
}

/* A cache row of hd fp8 values (kv_dtype) as dtype (exact: fp8 values are bfloat16's too); by
 * table 32 (bfloat16) or 16 (float32) at a time where the CPU has AVX512BW. */
static inline void dequantize_row(const uint8_t *src, int hd, int kv_dtype, int dtype, void *dst) {
    int d = 0;
#if KILN_FP8_SIMD
    const Fp8Tab tab = fp8_tab(kv_dtype);
    if (dtype == KILN_F32)
        for (; d + 16 <= hd; d += 16) _mm512_storeu_ps((float *)dst + d, fp8x16_f32(src + d, &tab));
    else
        for (; d + 32 <= hd; d += 32)
            _mm512_storeu_si512((uint16_t *)dst + d, fp8x32_bf16(src + d, &tab));
#endif
    for (; d < hd; ++d) {
        const float f = fp8_to_f32(src[d], kv_dtype);
        if (dtype == KILN_F32)
            ((float *)dst)[d] = f;
        else
            ((uint16_t *)dst)[d] = f32_to_bf16(f);
    }
}

/* w->kp, w->vp [0, count): the cache rows of keys kb .. kb + nk - 1 of the unit's kv head, the
 * zero row for the rest (count >= nk, count <= PF_ROWS). An fp8 cache's rows are dequantized into
 * w->kv first, so every tile reads the query's dtype. */
static inline void key_rows(const Call *c, const int32_t *blocks, int kv_head, int kb, int nk,
                            int count, Scratch *w) {
    const int fp8 = c->kv_dtype != c->dtype, qe = elem_size(c->dtype);
    int64_t off = 0;
    for (int j = 0; j < count; ++j, off += c->slot_stride) {
        /* one division a cache block (a key's division and remainder took a fifth of a unit) */
        if (j < nk && (j == 0 || (kb + j) % c->block_size == 0))
            off = key_offset(c, blocks, kb + j, kv_head);
        const char *kr = (const char *)c->k_cache + off * c->elem;
        const char *vr = (const char *)c->v_cache + off * c->elem;
        if (j < nk && fp8) {
            char *kd = (char *)w->kv + (size_t)j * c->hd * qe;
            char *vd = (char *)w->kv + (size_t)(PF_ROWS + j) * c->hd * qe;
            dequantize_row((const uint8_t *)kr, c->hd, c->kv_dtype, c->dtype, kd);
            dequantize_row((const uint8_t *)vr, c->hd, c->kv_dtype, c->dtype, vd);
            kr = kd, vr = vd;
        }
        w->kp[j] = j < nk ? kr : w->zero;
        w->vp[j] = j < nk ? vr : w->zero;
    }
}

/* vpk [pairs][hd]: bfloat16 value rows vp[2j], vp[2j + 1] interleaved, one word per dim (what
 * dpbf16 reduces over: an AVX512-BF16 broadcast, an AMX B tile's rows). */
static inline void pack_value_pairs(const void *const *vp, int pairs, int hd, int32_t *vpk) {
    for (int j = 0; j < pairs; ++j) {
        const uint16_t *a = (const uint16_t *)vp[2 * j], *b = (const uint16_t *)vp[2 * j + 1];
        int32_t *dst = vpk + (int64_t)j * hd;
        int d = 0;
#if defined(__AVX512BW__)
        /* 16 dims at a time (a scalar loop here took about an eighth of the AMX path's time):
         * word 2i of the result is a's word i (index i of ab), word 2i + 1 b's (index 16 + i) */
        const __m512i lo = _mm512_setr_epi32(0x100000, 0x110001, 0x120002, 0x130003, 0x140004,
                                             0x150005, 0x160006, 0x170007, 0x180008, 0x190009,
                                             0x1a000a, 0x1b000b, 0x1c000c, 0x1d000d, 0x1e000e,
                                             0x1f000f);
        for (; d + 16 <= hd; d += 16) {
            const __m512i ab = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(a + d))),
                _mm256_loadu_si256((const __m256i *)(b + d)), 1); /* a[d..d+16], b[d..d+16] */
            _mm512_storeu_si512(dst + d, _mm512_permutexvar_epi16(lo, ab));
        }
#endif
        for (; d < hd; ++d) dst[d] = (int32_t)((uint32_t)a[d] | (uint32_t)b[d] << 16);
    }
}

/* The AMX path (prefill_amx.c): 1 where it serves this dtype and head size and the tiles are to
 * be had; unit_amx computes a unit as unit_simd does, its K tiles in w->kt. */
int prefill_amx_serves(int dtype, int hd);
/* a thread's tile configuration, before its first unit_amx and after its last */
void prefill_amx_begin(void);
void prefill_amx_end(void);
void unit_amx(const Call *c, const Unit *u, Scratch *w);
/* w->kt: a key block's K tiles (2 tiles of 16 keys x hd / 32 steps of 1 KiB), then a [16][hd]
 * float32 block of P.V sums */
#define PREFILL_AMX_KEY_TILES(hd) ((size_t)64 * (hd))
#define PREFILL_AMX_KT_BYTES(hd) (PREFILL_AMX_KEY_TILES(hd) + (size_t)64 * (hd))

#endif
