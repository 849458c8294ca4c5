/* Causal attention of long queries (prefills, prefill chunks) for CPU, blocked flash-style: K/V
 * read in place from the paged cache in blocks of keys, online softmax in float32, no [L, L]
 * scores. Short queries go to paged_attention.c's per-token loop instead.
 *
 * A work unit is (request, kv head, 16 * tb query tokens): every query head sharing that kv head
 * takes the same key and value loads (GQA). Query j of a request sits at position ctx + j (ctx =
 * seq_len - query length: context cached by earlier steps) and sees keys 0 .. ctx + j (only the
 * last `window` of them for a sliding-window layer: key blocks before a unit's first window are
 * skipped, keys before each lane's window masked; scores soft-capped first where the layer has
 * a cap). The tiles
 * (prefill_tiles.h) use AVX512-BF16 for bfloat16 (probabilities rounded to bfloat16 before P.V,
 * as SDPA does) and AVX512F for float32; AMX-BF16 tiles (prefill_amx.c) take bfloat16 where the
 * CPU has them and the head size is a multiple of 32; a scalar path serves any other CPU, head
 * size, or a caller asking for it (tests). Layouts: paged_attention.c's (q/out rows, cache,
 * block table). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"
#include "kernels.h"
#include "prefill_tiles.h"
#include "prefill_unit.h"

/* The portable path: one (token, head) at a time, keys in blocks, the same rounding points. */
static void unit_scalar(const Call *c, const Unit *u, Scratch *w) {
    const int hd = c->hd, q_begin = c->query_start[u->req];
    const int ctx = c->seq_lens[u->req] - (c->query_start[u->req + 1] - q_begin);
    const int32_t *blocks = c->block_table + (int64_t)u->req * c->bt_stride;
    float *qf = w->buf, *acc = w->buf + hd, *sc = w->buf + 2 * hd;
    for (int t = u->t0; t < u->t0 + u->nt; ++t)
        for (int g = 0; g < c->group; ++g) {
            const int head = u->kv_head * c->group + g, n_keys = ctx + (t - q_begin) + 1;
            for (int d = 0; d < hd; ++d)
                qf[d] = load_elem(c->q, t * c->q_stride + (int64_t)head * hd + d, c->dtype);
            float m = MASKED, l = 0.f;
            memset(acc, 0, sizeof(float) * hd);
            for (int kb = first_key(c, n_keys - 1); kb < n_keys; kb += PF_BK) {
                const int nk = n_keys - kb < PF_BK ? n_keys - kb : PF_BK;
                float mx = m;
                for (int j = 0; j < nk; ++j) {
                    const int64_t off = key_offset(c, blocks, kb + j, u->kv_head);
                    float dot = 0.f;
                    for (int d = 0; d < hd; ++d)
                        dot += qf[d] * load_elem(c->k_cache, off + d, c->kv_dtype);
                    sc[j] = dot * c->scale;
                    soft_cap(c, sc + j, 1);
                    mx = sc[j] > mx ? sc[j] : mx;
                }
                const float alpha = expf(m - mx);
                l *= alpha;
                for (int d = 0; d < hd; ++d) acc[d] *= alpha;
                for (int j = 0; j < nk; ++j) {
                    const float p = expf(sc[j] - mx), pr = round_to(p, c->dtype);
                    const int64_t off = key_offset(c, blocks, kb + j, u->kv_head);
                    l += p;
                    for (int d = 0; d < hd; ++d)
                        acc[d] += pr * load_elem(c->v_cache, off + d, c->kv_dtype);
                }
                m = mx;
            }
            const int64_t row = t * c->out_stride + (int64_t)head * hd;
            for (int d = 0; d < hd; ++d)
                store_elem(c->out, row + d, acc[d] / l * c->v_scale, c->dtype);
        }
}

#if KILN_PREFILL_F32_SIMD
/* How far (in powers of 2) a lane's block maximum may pass the maximum its probabilities are
 * taken against before that moves (and its sums and outputs are rescaled): probabilities up to
 * 2^12 are exact enough in float32 and bfloat16 alike, and the rescale, a pass over the outputs,
 * comes seldom. */
#define PF_LAZY_MAX 12.f
#define PF_LOG2E 1.44269504088896341f

/* One key block's softmax step for a row group (16 lanes): raw scores s [nkp][16] masked past
 * each lane's position (and before its window) where the block reaches it, soft-capped where the
 * layer caps; the running maximum m (in powers of 2: scaled scores times log2(e)) moved where the
 * block's passes it by PF_LAZY_MAX, its factor into alpha (1 where it stays); probabilities
 * 2^(s * sscale * log2(e) - m) = e^(s * sscale - m / log2(e)) summed into l and, for bfloat16,
 * rounded into pp in key pairs (else back into s). Returns whether any alpha is not 1. */
static int softmax_step(const Call *c, float *s, int nkp, int kb, const int *pos, __m512i lane_lo,
                        float sscale, float *m, float *l, float *alpha, int32_t *pp) {
    const __m512i lane_pos = _mm512_loadu_si512(pos);
    const int need_mask = kb + nkp - 1 > pos[0]; /* lanes' positions ascend */
    const int need_lo_mask = kb < first_key(c, pos[15]);
    const __m512 masked = _mm512_set1_ps(MASKED);
    if (c->softcap > 0.f) { /* the cap takes scaled scores: scale them here, once */
        for (int j = 0; j < nkp; ++j) {
            _mm512_storeu_ps(s + 16 * j, _mm512_mul_ps(_mm512_loadu_ps(s + 16 * j),
                                                       _mm512_set1_ps(sscale)));
            soft_cap(c, s + 16 * j, 16);
        }
        sscale = 1.f;
    }
    __m512 mx = masked;
    for (int j = 0; j < nkp; ++j) {
        __m512 x = _mm512_loadu_ps(s + 16 * j);
        if (need_mask | need_lo_mask) {
            __mmask16 k = 0;
            if (need_mask) k = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(kb + j), lane_pos);
            if (need_lo_mask) k |= _mm512_cmpgt_epi32_mask(lane_lo, _mm512_set1_epi32(kb + j));
            x = _mm512_mask_mov_ps(x, k, masked);
            _mm512_storeu_ps(s + 16 * j, x);
        }
        mx = _mm512_max_ps(mx, x);
    }
    /* scale > 0: the maximum of the scaled scores is the scaled maximum (rounding is monotone) */
    const __m512 sc = _mm512_set1_ps(sscale * PF_LOG2E), m_old = _mm512_loadu_ps(m);
    mx = _mm512_mul_ps(mx, sc);
    const __mmask16 move = _mm512_cmp_ps_mask(mx, _mm512_add_ps(m_old, _mm512_set1_ps(PF_LAZY_MAX)),
                                              _CMP_GT_OQ);
    const __m512 m_new = _mm512_mask_mov_ps(m_old, move, mx);
    const __m512 a = _mm512_mask_mov_ps(_mm512_set1_ps(1.f), move,
                                        kiln_exp2_512(_mm512_sub_ps(m_old, m_new)));
    __m512 sum0 = _mm512_setzero_ps(), sum1 = sum0;
#define PF_PAIR                                                                           \
    const __m512 p0 = kiln_exp2_512(_mm512_fmsub_ps(_mm512_loadu_ps(s + 16 * j), sc, m_new));      \
    const __m512 p1 = kiln_exp2_512(_mm512_fmsub_ps(_mm512_loadu_ps(s + 16 * j + 16), sc, m_new)); \
    sum0 = _mm512_add_ps(sum0, p0), sum1 = _mm512_add_ps(sum1, p1)
#if KILN_PREFILL_BF16_SIMD
    if (pp)
        for (int j = 0; j < nkp; j += 2) {
            PF_PAIR;
            _mm512_storeu_si512(pp + 8 * j, pf_pair_words(p0, p1));
        }
    else
#endif
        for (int j = 0; j < nkp; j += 2) {
            PF_PAIR;
            _mm512_storeu_ps(s + 16 * j, p0);
            _mm512_storeu_ps(s + 16 * j + 16, p1);
        }
#undef PF_PAIR
    _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), a, _mm512_add_ps(sum0, sum1)));
    _mm512_storeu_ps(m, m_new);
    _mm512_storeu_ps(alpha, a);
    return move != 0;
}

/* A row group's queries into qp (prefill_tiles.h's layout): tokens t0 + i0 .. + 15 of the unit
 * (the last repeated past its end) of head `head`, 16 dims (or bfloat16 pairs) a transpose. */
static void pack_queries(const Call *c, const Unit *u, int head, int i0, float *qp) {
    const int hd = c->hd, bf = c->dtype == KILN_BF16, words = bf ? hd / 2 : hd;
    const char *rows[16];
    for (int i = 0; i < 16; ++i) {
        const int t = u->t0 + (i0 + i < u->nt ? i0 + i : u->nt - 1);
        rows[i] = (const char *)c->q + (t * c->q_stride + (int64_t)head * hd) * (bf ? 2 : 4);
    }
    const __m512 scale = _mm512_set1_ps(bf ? 1.f : c->scale); /* bfloat16's goes on the scores */
    int d0 = 0;
    for (; d0 + 16 <= words; d0 += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) {
            r[i] = _mm512_loadu_si512(rows[i] + 4 * d0);
            if (!bf) r[i] = _mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(r[i]), scale));
        }
        pf_transpose16(r);
        for (int k = 0; k < 16; ++k) _mm512_storeu_si512(qp + (d0 + k) * 16, r[k]);
    }
    for (; d0 < words; ++d0)
        for (int i = 0; i < 16; ++i)
            if (bf)
                ((int32_t *)qp)[d0 * 16 + i] = pf_word(rows[i] + 4 * d0);
            else
                qp[d0 * 16 + i] = ((const float *)rows[i])[d0] * c->scale;
}

/* 16 float32 lanes rounded to bfloat16 as f32_to_bf16 rounds them (NaN kept quiet). */
static inline __m256i bf16x16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v), hi = _mm512_srli_epi32(u, 16);
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                         _mm512_and_si512(hi, _mm512_set1_epi32(1))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    return _mm512_cvtepi32_epi16(
        _mm512_mask_or_epi32(rounded, nan, hi, _mm512_set1_epi32(0x40)));
}

/* A row group's outputs o [hd][16] / l into the out rows of tokens t0 + i0 .. (those of the unit)
 * of head `head`, 16 dims a transpose. */
static void store_outputs(const Call *c, const Unit *u, int head, int i0, const float *o,
                          const float *l) {
    const int hd = c->hd, n = u->nt - i0 < 16 ? u->nt - i0 : 16;
    const int64_t row0 = (u->t0 + i0) * c->out_stride + (int64_t)head * hd;
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(c->v_scale), _mm512_loadu_ps(l));
    int d0 = 0;
    for (; d0 + 16 <= hd; d0 += 16) {
        __m512i r[16];
        for (int k = 0; k < 16; ++k)
            r[k] = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(o + (d0 + k) * 16), inv));
        pf_transpose16(r);
        for (int i = 0; i < n; ++i) {
            const int64_t at = row0 + i * c->out_stride + d0;
            if (c->dtype == KILN_BF16)
                _mm256_storeu_si256((__m256i *)((uint16_t *)c->out + at),
                                    bf16x16(_mm512_castsi512_ps(r[i])));
            else
                _mm512_storeu_si512((float *)c->out + at, r[i]);
        }
    }
    for (; d0 < hd; ++d0)
        for (int i = 0; i < n; ++i)
            store_elem(c->out, row0 + i * c->out_stride + d0, o[d0 * 16 + i] * (c->v_scale / l[i]),
                       c->dtype);
}

/* Tiles of up to 3 row groups: constant R keeps the accumulators in registers. */
#define PF_DISPATCH(fn, R, ...)                 \
    switch (R) {                                \
        case 3: fn(__VA_ARGS__, 3); break;      \
        case 2: fn(__VA_ARGS__, 2); break;      \
        default: fn(__VA_ARGS__, 1);            \
    }

static void unit_simd(const Call *c, const Unit *u, Scratch *w) {
    const int hd = c->hd, tb = c->tb, rgs = c->group * tb, bf = c->dtype == KILN_BF16;
    const int q_begin = c->query_start[u->req];
    const int ctx = c->seq_lens[u->req] - (c->query_start[u->req + 1] - q_begin);
    const int32_t *blocks = c->block_table + (int64_t)u->req * c->bt_stride;
    const int64_t rg_q = (int64_t)(bf ? hd / 2 : hd) * 16, rg_s = PF_SBK * 16, rg_o = hd * 16;
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
    for (int kb = first_key(c, pos[0]); kb < n_keys; kb += PF_SBK) {
        const int nk = n_keys - kb < PF_SBK ? n_keys - kb : PF_SBK;
        const int nkp = (nk + PF_KEYS - 1) / PF_KEYS * PF_KEYS;
        key_rows(c, blocks, u->kv_head, kb, nk, nkp, w);
        for (int r0 = 0; r0 < rgs; r0 += 3) {
            const int R = rgs - r0 < 3 ? rgs - r0 : 3;
            for (int j0 = 0; j0 < nkp; j0 += PF_KEYS) {
#if KILN_PREFILL_BF16_SIMD
                if (bf) {
                    PF_DISPATCH(qk_bf16, R, (const int32_t *)w->qp + r0 * rg_q, rg_q,
                                (const uint16_t *const *)w->kp + j0, hd,
                                w->s + r0 * rg_s + j0 * 16, rg_s)
                    continue;
                }
#endif
                PF_DISPATCH(qk_f32, R, w->qp + r0 * rg_q, rg_q, (const float *const *)w->kp + j0,
                            hd, w->s + r0 * rg_s + j0 * 16, rg_s)
            }
        }
        const int64_t rg_p = PF_SBK / 2 * 16;
        int rescale = 0;
        for (int rg = 0; rg < rgs; ++rg)
            rescale |= softmax_step(c, w->s + rg * rg_s, nkp, kb, pos + 16 * (rg % tb),
                                    lane_lo[rg % tb], bf ? c->scale : 1.f, w->m + rg * 16,
                                    w->l + rg * 16, w->alpha + rg * 16,
                                    bf ? w->pp + rg * rg_p : NULL);
        const float *alpha = rescale ? w->alpha : NULL;
#if KILN_PREFILL_BF16_SIMD
        if (bf) {
            const int pairs = (nk + 1) / 2; /* vp holds nkp >= 2 * pairs rows, zeros past nk */
            pack_value_pairs(w->vp, pairs, hd, w->vpk);
            for (int r0 = 0; r0 < rgs; r0 += 3) {
                const int R = rgs - r0 < 3 ? rgs - r0 : 3;
                for (int c0 = 0; c0 < hd; c0 += PF_DIMS)
                    PF_DISPATCH(pv_bf16, R, w->pp + r0 * rg_p, rg_p, w->vpk, hd, pairs, c0,
                                w->o + r0 * rg_o, rg_o, alpha ? alpha + 16 * r0 : NULL)
            }
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
     * as the longest query fills: 2 requests of 512 over 1024, 9 heads over 3, 1 / 2 threads,
     * 16 tokens a unit 18 / 9.5 ms, 64 14 / 8.1 (a bfloat16 cache 14-17 / 8-8.4). */
    int tb = group >= 3 ? 1 : 3 / group;
    if (cache->kv_dtype != cache->dtype) {
        int longest = 0;
        for (int i = 0; i < st->num_sel; ++i) {
            const int r = st->reqs[i], n = st->query_start[r + 1] - st->query_start[r];
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
    int64_t n = 0;
    for (int i = 0; i < st->num_sel; ++i) { /* a request's last tokens first: they cost most */
        const int r = st->reqs[i], q0 = st->query_start[r], q1 = st->query_start[r + 1];
        for (int t0 = q0 + (q1 - q0 - 1) / per_unit * per_unit; q1 > q0 && t0 >= q0; t0 -= per_unit)
            for (int h = 0; h < nkv; ++h, ++n) {
                units[n].req = r, units[n].kv_head = h, units[n].t0 = t0;
                units[n].nt = q1 - t0 < per_unit ? q1 - t0 : per_unit;
            }
    }
    const Call call = {q, cache->key, cache->value, out, q_stride, out_stride,
                       (int64_t)nkv * hd, st->bt_stride, st->block_table, st->query_start,
                       st->seq_lens, cache->block_size, hd, group, tb, cache->dtype,
                       elem_size(cache->kv_dtype), cache->kv_dtype,
                       scale * cache->k_scale, cache->v_scale, window > 0 ? window : 0,
                       softcap > 0.f ? softcap : 0.f};
    const int rgs = group * tb;
    /* per row group qp, o, s, pp, m, l, alpha; then vpk, the scalar path's rows and the zero row,
     * the AMX K tiles, an fp8 cache's dequantized key block */
    const size_t kt_floats = amx ? PREFILL_AMX_KT_BYTES(hd) / sizeof(float) : 0;
    const size_t floats = (size_t)rgs * 16 * (2 * hd + PF_ROWS + PF_ROWS / 2 + 3) +
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
            w.m = (float *)(w.pp + (size_t)rgs * PF_ROWS / 2 * 16);
            w.l = w.m + rgs * 16;
            w.alpha = w.l + rgs * 16;
            w.vpk = (int32_t *)(w.alpha + rgs * 16);
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
    return failed;
}
