/* Causal attention of long queries (prefills, prefill chunks) for CPU, blocked flash-style: K/V
 * read in place from the paged cache in blocks of keys, online softmax in float32, no [L, L]
 * scores. Short queries go to paged_attention.c's per-token loop instead.
 *
 * A work unit is (request, kv head, 16 * tb query tokens): every query head sharing that kv head
 * takes the same key and value loads (GQA). Query j of a request sits at position ctx + j (ctx =
 * seq_len - query length: context cached by earlier steps) and sees keys 0 .. ctx + j (only the
 * last `window` of them for a sliding-window layer: key blocks before a unit's first window are
 * skipped, keys before each lane's window masked; scores soft-capped first where the layer has a
 * cap). The tiles (prefill_tiles.h; their online softmax prefill_softmax.h, their query and output
 * rows prefill_rows.h) use AVX512-BF16 for bfloat16 (probabilities rounded to bfloat16 before P.V,
 * as SDPA does) and AVX512F for float32; AMX-BF16 tiles (prefill_amx.c) take bfloat16 where the
 * CPU has them and the head size is a multiple of 32; a scalar path (prefill_scalar.h) serves any
 * other CPU, head size, or a caller asking for it (tests). The AVX512-BF16 tiles read a long
 * request's keys gathered once a call (prefill_gather.h). Layouts: paged_attention.c's (q/out
 * rows, cache, block table). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"
#include "kernels.h"
#include "prefill_gather.h"
#include "prefill_rows.h"
#include "prefill_scalar.h"
#include "prefill_softmax.h"
#include "prefill_tiles.h"
#include "prefill_unit.h"

#if KILN_PREFILL_F32_SIMD
/* Tiles of up to 3 row groups: constant R keeps the accumulators in registers. */
#define PF_DISPATCH(fn, R, ...)                 \
    switch (R) {                                \
        case 3: fn(__VA_ARGS__, 3); break;      \
        case 2: fn(__VA_ARGS__, 2); break;      \
        default: fn(__VA_ARGS__, 1);            \
    }

/* Used by the softmax on every build, by the P.V tiles only with AVX512-BF16. */
#define PF_RG_P (PF_SBK * 16) /* pp words a row group: a held block's pairs, then the next's */
#if KILN_PREFILL_BF16_SIMD
/* The P.V tiles of every row group over pp's pairs from word pp0 (a second block's from split,
 * else split = pairs) against vpk: pv_bf16's arguments. */
static inline void pf_values(const Call *c, Scratch *w, int64_t pp0, int pairs, int split,
                             const int32_t *vpk, const float *alpha, const float *alpha2) {
    const int hd = c->hd, rgs = c->group * c->tb;
    for (int r0 = 0; r0 < rgs; r0 += 3) {
        const int R = rgs - r0 < 3 ? rgs - r0 : 3;
        for (int c0 = 0; c0 < hd; c0 += PF_DIMS)
            PF_DISPATCH(pv_bf16, R, w->pp + pp0 + r0 * PF_RG_P, PF_RG_P, vpk, hd, pairs, split,
                        c0, w->o + r0 * hd * 16, hd * 16, alpha ? alpha + 16 * r0 : NULL,
                        alpha2 ? alpha2 + 16 * r0 : NULL)
    }
}
#endif

static void unit_simd(const Call *c, const Unit *u, Scratch *w) {
    const int hd = c->hd, tb = c->tb, rgs = c->group * tb, bf = c->dtype == KILN_BF16;
    const int q_begin = c->query_start[u->req];
    const int ctx = c->seq_lens[u->req] - (c->query_start[u->req + 1] - q_begin);
    const int32_t *blocks = c->block_table + (int64_t)u->req * c->bt_stride;
    const int64_t rg_q = (int64_t)(bf ? hd / 2 : hd) * 16, rg_s = PF_SBK * 16, rg_o = hd * 16;
    uint16_t *g = u->gathered >= 0 ? c->gather + u->gathered : NULL; /* K, then V pairs */
    int pos[16 * 4]; /* each lane's query position; padding lanes repeat the unit's last token */
    for (int i = 0; i < 16 * tb; ++i)
        pos[i] = ctx + (u->t0 + (i < u->nt ? i : u->nt - 1) - q_begin);
    for (int g = 0; g < c->group; ++g)
        for (int b = 0; b < tb; ++b)
            pack_queries(c, u, u->kv_head * c->group + g, 16 * b, w->qp + (g * tb + b) * rg_q);
    __m512i lane_lo[4]; /* each lane's first key (its window's start): keys before it are masked */
    for (int b = 0; b < tb; ++b) {
        int lo[16];
        for (int i = 0; i < 16; ++i) lo[i] = first_key(c, pos[16 * b + i]);
        lane_lo[b] = _mm512_loadu_si512(lo);
    }
    memset(w->o, 0, sizeof(float) * rgs * rg_o);
    for (int i = 0; i < rgs * 16; ++i) w->m[i] = MASKED, w->l[i] = 0.f;
    const int n_keys = pos[u->nt - 1] + 1;
    /* a gathered block's P.V waits for the next block's where that is gathered too: one pass of
     * the P.V tiles over both, their accumulators loaded and stored once */
    int held = 0, cur = 0; /* w->alpha's half that this block's factors go to */
    const int32_t *held_vpk = NULL;
    const float *held_alpha = NULL; /* the held block's factors (NULL: all 1) */
    for (int kb = first_key(c, pos[0]); kb < n_keys; kb += PF_SBK) {
        const int nk = n_keys - kb < PF_SBK ? n_keys - kb : PF_SBK;
        const int nkp = (nk + PF_KEYS - 1) / PF_KEYS * PF_KEYS;
        const int gathered = g && take_block(c, u, kb, g, w);
        if (gathered)
            for (int j = 0; j < nkp; ++j) w->kp[j] = g + (int64_t)(kb + j) * hd;
        else
            key_rows(c, blocks, u->kv_head, kb, nk, nkp, w);
        for (int i = 0; i < rgs * 16; ++i) w->bm[i] = MASKED;
        for (int r0 = 0; r0 < rgs; r0 += 3) {
            const int R = rgs - r0 < 3 ? rgs - r0 : 3;
            for (int j0 = 0; j0 < nkp; j0 += PF_KEYS) {
#if KILN_PREFILL_BF16_SIMD
                if (bf) {
                    PF_DISPATCH(qk_bf16, R, (const int32_t *)w->qp + r0 * rg_q, rg_q,
                                (const uint16_t *const *)w->kp + j0, hd,
                                w->s + r0 * rg_s + j0 * 16, rg_s, w->bm + 16 * r0)
                    continue;
                }
#endif
                PF_DISPATCH(qk_f32, R, w->qp + r0 * rg_q, rg_q, (const float *const *)w->kp + j0,
                            hd, w->s + r0 * rg_s + j0 * 16, rg_s)
            }
        }
        int32_t *pp = w->pp + (held ? PF_SBK / 2 * 16 : 0); /* a held block's pairs first */
        int rescale = 0;
        for (int rg = 0; rg < rgs; ++rg)
            rescale |= softmax_step(c, w->s + rg * rg_s, nkp, kb, pos + 16 * (rg % tb),
                                    lane_lo[rg % tb], bf ? c->scale : 1.f, w->m + rg * 16,
                                    w->l + rg * 16, w->alpha + (cur * rgs + rg) * 16,
                                    bf ? pp + rg * PF_RG_P : NULL, bf ? w->bm + rg * 16 : NULL);
        const float *alpha = rescale ? w->alpha + cur * rgs * 16 : NULL;
#if KILN_PREFILL_BF16_SIMD
        if (bf) {
            const int pairs = (nk + 1) / 2; /* vp holds nkp >= 2 * pairs rows, zeros past nk */
            const int32_t *vpk = /* V pairs after the gathered K rows */
                gathered ? (const int32_t *)(g + gather_keys(c->seq_lens[u->req]) * hd) +
                               (int64_t)kb / 2 * hd
                         : w->vpk;
            if (!held && gathered && kb + PF_SBK < n_keys) { /* a full block, not the last */
                held = 1, held_vpk = vpk, held_alpha = alpha, cur ^= 1;
                continue;
            }
            if (held && !gathered) /* this block's V pairs do not follow the held one's */
                pf_values(c, w, 0, PF_SBK / 2, PF_SBK / 2, held_vpk, held_alpha, NULL);
            if (!gathered) pack_value_pairs(w->vp, pairs, hd, w->vpk);
            if (held && gathered)
                pf_values(c, w, 0, PF_SBK / 2 + pairs, PF_SBK / 2, held_vpk, held_alpha, alpha);
            else
                pf_values(c, w, pp - w->pp, pairs, pairs, vpk, alpha, NULL);
            held = 0;
            continue;
        }
#endif
        for (int r0 = 0; r0 < rgs; r0 += 3) {
            const int R = rgs - r0 < 3 ? rgs - r0 : 3;
            for (int c0 = 0; c0 < hd; c0 += PF_DIMS)
                PF_DISPATCH(pv_f32, R, w->s + r0 * rg_s, rg_s, (const float *const *)w->vp, nk,
                            c0, w->o + r0 * rg_o, rg_o, alpha ? alpha + 16 * r0 : NULL)
        }
    }
    for (int rg = 0; rg < rgs; ++rg) {
        const int g = rg / tb, b = rg % tb;
        store_outputs(c, u, u->kv_head * c->group + g, 16 * b, w->o + rg * rg_o, w->l + rg * 16);
    }
}
#endif

/* Asks for a unit's query rows (into L2) and out rows (for writing) while the unit before it is
 * computed: they come from memory once, and waiting on them in the unit's query packing and
 * output stores took about a tenth of the kernel (4 x 512 tokens, 9 heads of 64 over 3). */
static void prefetch_unit(const Call *c, const Unit *u) {
    const int qe = c->dtype == KILN_BF16 ? 2 : 4, bytes = c->group * c->hd * qe;
    const int64_t head0 = (int64_t)u->kv_head * c->group * c->hd;
    for (int t = u->t0; t < u->t0 + u->nt; ++t) {
        const char *q = (const char *)c->q + (t * c->q_stride + head0) * qe;
        char *o = (char *)c->out + (t * c->out_stride + head0) * qe;
        for (int b = 0; b < bytes; b += 64) {
            __builtin_prefetch(q + b, 0, 2);
            __builtin_prefetch(o + b, 1, 2);
        }
    }
}

/* Whether the SIMD tiles serve this dtype and head size (the tiles step dims by PF_DIMS). */
static int simd_serves(int dtype, int hd) {
    if (hd % PF_DIMS) return 0;
    return dtype == KILN_BF16 ? KILN_PREFILL_BF16_SIMD : KILN_PREFILL_F32_SIMD;
}

int kiln_prefill_attention_simd(int32_t dtype, int32_t head_size) {
    return simd_serves(dtype, head_size);
}

int kiln_prefill_attention_amx(int32_t dtype, int32_t head_size) {
    return simd_serves(dtype, head_size) && prefill_amx_serves(dtype, head_size);
}

/* out rows of the step's selected requests from q (num_rows rows) and the cache, whose K/V the
 * step has written already. path: KILN_PREFILL_BEST the fastest that serves, KILN_PREFILL_AVX512
 * the AVX512 tiles even where AMX's serve, KILN_PREFILL_PORTABLE the scalar path (tests).
 * Returns 0 or paged_attention.h's error bits. */
int kiln_prefill_attention(const void *q, int64_t q_stride, void *out, int64_t out_stride,
                           int64_t num_rows, int32_t num_heads, float scale, int32_t window,
                           float softcap, const KilnKvCache *cache, const KilnAttnStep *st,
                           int32_t path, int32_t num_threads) {
    const int nkv = cache->num_kv_heads, hd = cache->head_size;
    if (nkv <= 0 || num_heads % nkv || cache->block_size <= 0 || hd <= 0)
        return KILN_ATTN_BAD_HEADS;
    const int group = num_heads / nkv;
    const int simd = path != KILN_PREFILL_PORTABLE && simd_serves(cache->dtype, hd);
    const int amx = simd && path == KILN_PREFILL_BEST && prefill_amx_serves(cache->dtype, hd);
    /* tokens per unit in lanes of 16: enough row groups for a tile of 3, at most 4 lanes' worth.
     * Over an fp8 cache a unit dequantizes each key block it reads, so units take as many lanes
     * as the longest query whose keys are not gathered fills: 2 requests of 512 over 1024, 9
     * heads over 3, 1 / 2 threads, 16 tokens a unit 18 / 9.5 ms, 64 14 / 8.1 (a bfloat16 cache
     * 14-17 / 8-8.4; both before keys were gathered). */
    int tb = group >= 3 ? 1 : 3 / group;
    /* the bfloat16 tiles' keys gathered once a call (prefill_gather.h) where no window moves
     * their blocks' starts: an fp8 cache's are then dequantized once, and units stay small */
    const int can_gather = simd && !amx && cache->dtype == KILN_BF16 && window <= 0;
    if (cache->kv_dtype != cache->dtype) {
        int longest = 0;
        for (int i = 0; i < st->num_sel; ++i) {
            const int r = st->reqs[i], n = st->query_start[r + 1] - st->query_start[r];
            if (can_gather && gathers(st, r)) continue;
            longest = n > longest ? n : longest;
        }
        const int lanes = (longest + 15) / 16;
        tb = lanes > 4 ? 4 : lanes > tb ? lanes : tb;
    }
    const int per_unit = simd ? 16 * tb : 16;
    int64_t num_units = 0;
    for (int i = 0; i < st->num_sel; ++i) {
        const int r = st->reqs[i], q0 = st->query_start[r], q1 = st->query_start[r + 1];
        if (q0 < 0 || q1 < q0 || q1 > num_rows || st->seq_lens[r] > st->max_seq_len ||
            st->seq_lens[r] < q1 - q0)
            return KILN_ATTN_BAD_LENGTHS;
        num_units += (int64_t)(q1 - q0 + per_unit - 1) / per_unit * nkv;
    }
    if (num_units == 0) return 0;
    Unit *units = (Unit *)malloc(sizeof(Unit) * num_units);
    if (!units) return KILN_ATTN_NO_MEMORY;
    int64_t n = 0, at = 0, task = 0;
    int *gather_state = NULL;
    uint16_t *gathered = can_gather ? plan_gather(st, nkv, hd, &gather_state) : NULL;
    for (int i = 0; i < st->num_sel; ++i) { /* a request's last tokens first: they cost most */
        const int r = st->reqs[i], q0 = st->query_start[r], q1 = st->query_start[r + 1];
        const int64_t head_rows = gathered && gathers(st, r)
                                      ? gather_bytes(st->seq_lens[r], hd) / 2 : 0;
        const int blocks = head_rows ? (st->seq_lens[r] + PF_SBK - 1) / PF_SBK : 0;
        for (int t0 = q0 + (q1 - q0 - 1) / per_unit * per_unit; q1 > q0 && t0 >= q0; t0 -= per_unit)
            for (int h = 0; h < nkv; ++h, ++n) {
                units[n].req = r, units[n].kv_head = h, units[n].t0 = t0;
                units[n].nt = q1 - t0 < per_unit ? q1 - t0 : per_unit;
                units[n].gathered = head_rows ? at + h * head_rows : -1; /* plan_gather's order */
                units[n].task0 = task + (int64_t)h * blocks;
            }
        at += head_rows * nkv, task += (int64_t)blocks * nkv;
    }
    const Call call = {q, cache->key, cache->value, out, q_stride, out_stride,
                       (int64_t)nkv * hd, st->bt_stride, st->block_table, st->query_start,
                       st->seq_lens, cache->block_size, hd, group, tb, cache->dtype,
                       elem_size(cache->kv_dtype), cache->kv_dtype,
                       scale * cache->k_scale, cache->v_scale, window > 0 ? window : 0,
                       softcap > 0.f ? softcap : 0.f, gathered, gather_state};
    const int rgs = group * tb;
    /* per row group qp, o, s, pp, m, l, alpha, bm; then vpk, the scalar path's rows and the zero
     * row, the AMX K tiles, an fp8 cache's dequantized key block */
    const size_t kt_floats = amx ? PREFILL_AMX_KT_BYTES(hd) / sizeof(float) : 0;
    const size_t floats = (size_t)rgs * 16 * (2 * hd + PF_ROWS + PF_ROWS + 5) +
                          (size_t)PF_ROWS / 2 * hd + 3 * (size_t)hd + PF_ROWS + kt_floats +
                          (cache->kv_dtype != cache->dtype ? (size_t)2 * PF_ROWS * hd : 0);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *mem = (float *)calloc(floats, sizeof(float));
        const void **ptrs = (const void **)malloc(sizeof(void *) * 2 * PF_ROWS);
        Scratch w;
        memset(&w, 0, sizeof w);
        if (mem && ptrs) { /* carved from one block; every part a multiple of 16 floats */
            w.qp = mem;
            w.o = w.qp + (size_t)rgs * hd * 16;
            w.s = w.o + (size_t)rgs * hd * 16;
            w.pp = (int32_t *)(w.s + (size_t)rgs * PF_ROWS * 16);
            w.m = (float *)(w.pp + (size_t)rgs * PF_ROWS * 16);
            w.l = w.m + rgs * 16;
            w.alpha = w.l + rgs * 16;
            w.bm = w.alpha + 2 * rgs * 16;
            w.vpk = (int32_t *)(w.bm + rgs * 16);
            w.buf = (float *)(w.vpk + (size_t)PF_ROWS / 2 * hd);
            w.zero = w.buf + 2 * hd + PF_ROWS; /* hd floats, never written */
            w.kt = (float *)w.zero + hd;
            w.kv = (float *)w.kt + kt_floats;
            w.kp = ptrs;
            w.vp = ptrs + PF_ROWS;
        } else {
            failed = KILN_ATTN_NO_MEMORY;
        }
        if (amx) prefill_amx_begin();
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_units; ++i) {
            if (failed) continue;
            if (i + 1 < num_units) prefetch_unit(&call, &units[i + 1]);
            if (amx) {
                unit_amx(&call, &units[i], &w);
                continue;
            }
#if KILN_PREFILL_F32_SIMD
            if (simd) {
                unit_simd(&call, &units[i], &w);
                continue;
            }
#endif
            unit_scalar(&call, &units[i], &w);
        }
        if (amx) prefill_amx_end();
        free(mem);
        free(ptrs);
    }
    free(units);
    free(gather_state);
    free(gathered);
    return failed;
}
