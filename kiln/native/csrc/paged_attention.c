/* Paged causal attention for CPU, reading K and V straight out of the block cache.
 *
 * The torch path gathers each request's blocks into a contiguous copy and transposes it before
 * its matmuls: three passes over the KV bytes. This kernel makes one, which is what a decode
 * step (memory-bound on the KV cache) needs. Built at run time by kiln/native/build.py
 * and called through ctypes; OpenMP comes from the libgomp torch has already loaded.
 *
 * Layouts (element strides given where a tensor may be a view):
 *   q, out       [tokens, num_heads * head_size], token stride q_stride / out_stride
 *   k, v         [tokens, num_kv_heads * head_size], token stride k_stride / v_stride
 *   k/v_cache    [num_blocks, block_size, num_kv_heads, head_size], contiguous
 *   block_table  [num_reqs, bt_stride] int32
 *   query_start  [num_reqs + 1] int32; seq_lens [num_reqs] int32 (context incl. this step)
 *   reqs         [num_sel] int32: the requests this call computes (the rest are left alone)
 *   slots        [num_tokens] int64: each token's cache slot, -1 for none (padding)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"
#include "kernels.h"
#include "paged_attention.h"
#include "paged_attention_blocks.h"
#include "paged_attention_rows.h"
#include "paged_attention_split.h"

/* Whether attend_token takes them for bfloat16 queries over a cache of `dtype` (reported to
 * Python by the same function): a bfloat16 cache as it is, an fp8 cache's key rows converted to
 * bfloat16 by table (exact; the float32 path converted each row once per query head). Its p . v
 * then runs on them too, the softmax weights rounded to bfloat16 (paged_attention_pv.h). */
int kiln_paged_attention_bf16_dot(int32_t dtype, int32_t head_size) {
    const int fp8 = KILN_FP8_SIMD && (dtype == KILN_FP8E4M3 || dtype == KILN_FP8E5M2);
    return KILN_ATTN_BF16_DOT && (dtype == KILN_BF16 || fp8) && head_size > 0 &&
           head_size % 32 == 0;
}

/* One query token against keys [k0, n_keys) of kv heads [h0, h0 + nh_kv), each shared by `group`
 * query heads. qs [nh_kv * group, hd] is pre-scaled; qb, where not NULL, the same rows as the
 * bfloat16 query holds them (unscaled: `scale` is applied to their dot products); scores
 * [nh_kv * group, max(n_keys - k0, CHUNK_SCRATCH)]; slots [n_keys - k0]. Out: acc (like qs) =
 * sum of exp(score - mx) * value, denom = sum of exp(score - mx), mx = the row's largest score
 * (the AVX-512 path's: up to LAZY_MAX below it).
 * A key's heads sit next to each other, so taking them together reads the cache in whole rows.
 * AVX-512: by chunks of a block (paged_attention_blocks.h); else all scores, then all values,
 * the value rows prefetched with the key rows, so that memory is read in one stream. */
static inline __attribute__((always_inline)) void attend_token(
    const float *qs, const uint16_t *qb, float scale, const void *k_cache, const void *v_cache,
    const int32_t *blocks, int block_size, int n_keys, int h0, int nh_kv, int64_t slot_stride,
    int group, int dtype, float *scores, float *acc, float *buf, float *denom, int64_t *slots,
    int k0, float *mx, float softcap, const int hd) {
#if KILN_ATTN_SIMD
    if (hd % 16 == 0) {
        attend_blocks(qs, qb, scale, k_cache, v_cache, blocks, block_size, n_keys, h0, nh_kv,
                      slot_stride, group, dtype, scores, acc, buf, denom, k0, mx, softcap, hd);
        return;
    }
#endif
    const int rows = nh_kv * group, elem = elem_size(dtype), nk = n_keys - k0;
    const int64_t head_off = (int64_t)h0 * hd, span = (int64_t)nh_kv * hd;
    for (int s = 0; s < nk; ++s) slots[s] = key_slot(blocks, block_size, k0 + s);
    /* The loops below ask for key s + PREFETCH_AHEAD while on key s: ask for the first ones
     * here, or they are read with nothing in flight (a short context is mostly those). Per
     * layer, caches out of L3, 2 threads: 8 requests of 56 keys 48 -> 40 us, 32 of 40 143 ->
     * 108, 1 of 56 13.3 -> 11.6, 8 of 250 165 -> 155. */
    for (int s = 0; s < PREFETCH_AHEAD && s < nk; ++s) {
        prefetch_rows(k_cache, blocks, block_size, k0 + s, n_keys, slot_stride, head_off, span,
                      elem);
        prefetch_rows(v_cache, blocks, block_size, k0 + s, n_keys, slot_stride, head_off, span,
                      elem);
    }
    for (int s = 0; s < nk; ++s) {
        prefetch_rows(k_cache, blocks, block_size, k0 + s + PREFETCH_AHEAD, n_keys, slot_stride,
                      head_off, span, elem);
        prefetch_rows(v_cache, blocks, block_size, k0 + s + PREFETCH_AHEAD, n_keys, slot_stride,
                      head_off, span, elem);
        for (int h = 0; h < nh_kv; ++h) {
            const float *kr = row_f32(k_cache, slots[s] * slot_stride + (int64_t)(h0 + h) * hd,
                                      hd, dtype, buf);
            for (int g = 0; g < group; ++g) {
                const float *qg = qs + (int64_t)(h * group + g) * hd;
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < hd; ++d) dot += qg[d] * kr[d];
                scores[(int64_t)(h * group + g) * nk + s] = dot;
            }
        }
    }
    if (softcap > 0.f) /* Gemma-2's soft cap of the scaled scores: cap * tanh(score / cap) */
        for (int64_t i = 0; i < (int64_t)rows * nk; ++i)
            scores[i] = softcap * tanhf(scores[i] / softcap);
    for (int r = 0; r < rows; ++r) {
        float *sr = scores + (int64_t)r * nk;
        float m = sr[0], sum = 0.f;
        for (int s = 1; s < nk; ++s) m = sr[s] > m ? sr[s] : m;
        for (int s = 0; s < nk; ++s) {
            sr[s] = expf(sr[s] - m);
            sum += sr[s];
        }
        denom[r] = sum;
        mx[r] = m;
    }
    memset(acc, 0, sizeof(float) * rows * hd);
    for (int s = 0; s < nk; ++s) {
        prefetch_rows(v_cache, blocks, block_size, k0 + s + PREFETCH_AHEAD, n_keys, slot_stride,
                      head_off, span, elem);
        for (int h = 0; h < nh_kv; ++h) {
            const float *vr = row_f32(v_cache, slots[s] * slot_stride + (int64_t)(h0 + h) * hd,
                                      hd, dtype, buf);
            for (int g = 0; g < group; ++g) {
                const float p = scores[(int64_t)(h * group + g) * nk + s];
                float *ar = acc + (int64_t)(h * group + g) * hd;
#pragma omp simd
                for (int d = 0; d < hd; ++d) ar[d] += p * vr[d];
            }
        }
    }
}

/* Copies of attend_token with the head size fixed, so its inner loops unroll into whole vector
 * registers: the common sizes, and any other through the generic one. */
#define ATTEND_TOKEN_ARGS                                                                    \
    const float *qs, const uint16_t *qb, float scale, const void *k_cache, const void *v_cache, \
        const int32_t *blocks, int block_size, int n_keys, int h0, int nh_kv,                \
        int64_t slot_stride, int group, int dtype, float *scores, float *acc, float *buf,    \
        float *denom, int64_t *slots, int k0, float *mx, float softcap
#define ATTEND_TOKEN_PASS                                                                    \
    qs, qb, scale, k_cache, v_cache, blocks, block_size, n_keys, h0, nh_kv, slot_stride,     \
        group, dtype, scores, acc, buf, denom, slots, k0, mx, softcap
static void attend_token_64(ATTEND_TOKEN_ARGS) { attend_token(ATTEND_TOKEN_PASS, 64); }
static void attend_token_128(ATTEND_TOKEN_ARGS) { attend_token(ATTEND_TOKEN_PASS, 128); }
static void attend_token_any(ATTEND_TOKEN_ARGS, int hd) { attend_token(ATTEND_TOKEN_PASS, hd); }

static void attend_token_hd(ATTEND_TOKEN_ARGS, int hd) {
    if (hd == 64)
        attend_token_64(ATTEND_TOKEN_PASS);
    else if (hd == 128)
        attend_token_128(ATTEND_TOKEN_PASS);
    else
        attend_token_any(ATTEND_TOKEN_PASS, hd);
}

/* Attention of the step's selected requests (their k/v already in the cache) into out. */
static int attend(const void *q, int64_t q_stride, void *out, int64_t out_stride, int num_heads,
                  float scale, int window, float softcap, const KilnKvCache *c,
                  const KilnAttnStep *st, int num_threads) {
    const void *k_cache = c->key, *v_cache = c->value;
    const int32_t *block_table = st->block_table, *query_start = st->query_start;
    const int32_t *seq_lens = st->seq_lens, *reqs = st->reqs;
    const int64_t bt_stride = st->bt_stride;
    const int num_sel = st->num_sel, max_seq_len = st->max_seq_len;
    const int num_kv_heads = c->num_kv_heads, head_size = c->head_size;
    const int block_size = c->block_size, dtype = c->dtype;
    /* an fp8 cache's scales: K's folds into the scores' scale, V's into the outputs' 1 / sum */
    const float v_scale = c->v_scale;
    scale *= c->k_scale;
    if (num_kv_heads <= 0 || num_heads % num_kv_heads || block_size <= 0 || head_size <= 0)
        return KILN_ATTN_BAD_HEADS;
    const int group = num_heads / num_kv_heads, hd = head_size;
    const int64_t slot_stride = (int64_t)num_kv_heads * hd;
    /* Work items: a request with all its kv heads when there are enough requests to keep every
     * thread busy (whole cache rows), else one (request, kv head) each. */
    const int split_heads = num_sel < 2 * num_threads;
    const int heads_per_item = split_heads ? 1 : num_kv_heads;
    const int per_req = num_kv_heads / heads_per_item;
    const int64_t items = (int64_t)num_sel * per_req;
    const size_t rows = (size_t)heads_per_item * group, unit_floats = rows * ((size_t)hd + 2);
    /* a windowed layer's query reads at most `window` keys, however long its context */
    const int most_keys = window > 0 && window < max_seq_len ? window : max_seq_len;
    const int parts = key_parts(items, num_threads, most_keys, reqs, num_sel, query_start);
    /* parts > 1: per (item, part), rows x hd unnormalized outputs, then rows sums and maxima */
    float *partial =
        parts > 1 ? (float *)malloc(sizeof(float) * (size_t)(items * parts) * unit_floats) : NULL;
    if (parts > 1 && !partial) return KILN_ATTN_NO_MEMORY;
    int failed = 0, any_failed = 0; /* any_failed: shared, so every thread skips the merge */
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const size_t score_cols = max_seq_len > CHUNK_SCRATCH ? (size_t)max_seq_len : CHUNK_SCRATCH;
        float *scores = (float *)malloc(sizeof(float) * rows * score_cols);
        float *qs = (float *)malloc(sizeof(float) * rows * (size_t)hd);
        float *acc = (float *)malloc(sizeof(float) * rows * (size_t)hd);
        /* 16 bfloat16 key rows, then the query rows in pair_query's form (attend_blocks) */
        float *buf = (float *)malloc(sizeof(float) * (8 + rows) * (size_t)hd);
        float *denom = (float *)malloc(sizeof(float) * rows);
        float *mx = (float *)malloc(sizeof(float) * rows);
        int64_t *slots = (int64_t *)malloc(sizeof(int64_t) * (size_t)max_seq_len);
        failed = (!scores || !qs || !acc || !buf || !denom || !mx || !slots) ? KILN_ATTN_NO_MEMORY
                                                                             : 0;
        if (failed) {
#pragma omp atomic write
            any_failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t unit = 0; unit < items * parts; ++unit) {
            if (failed) continue;
            const int64_t item = unit / parts;
            const int part = (int)(unit % parts);
            const int r = reqs[item / per_req], h0 = (int)(item % per_req) * heads_per_item;
            const int q_begin = query_start[r], q_end = query_start[r + 1];
            const int ctx = seq_lens[r] - (q_end - q_begin);
            if (seq_lens[r] > max_seq_len || ctx < 0) { /* the scores buffer would overflow */
                failed = KILN_ATTN_BAD_LENGTHS;
#pragma omp atomic write
                any_failed = 1;
                continue;
            }
            const int32_t *blocks = block_table + (int64_t)r * bt_stride;
            for (int t = q_begin; t < q_end; ++t) {
                const int n_keys = ctx + (t - q_begin) + 1;  /* causal: keys up to its position */
                /* a sliding window: only the last `window` keys, its own included */
                const int lo = window > 0 && n_keys > window ? n_keys - window : 0;
                const int k0 = lo + (int)((int64_t)(n_keys - lo) * part / parts);
                const int k1 = lo + (int)((int64_t)(n_keys - lo) * (part + 1) / parts);
                float *u = parts > 1 ? partial + unit * unit_floats : NULL;
                float *o = parts > 1 ? u : acc, *sums = parts > 1 ? u + rows * hd : denom;
                float *maxima = parts > 1 ? sums + rows : mx;
                if (k1 == k0) { /* a part of a short request's keys can be empty */
                    for (size_t i = 0; i < rows; ++i) sums[i] = 0.f;
                    continue;
                }
                /* the query heads of kv heads [h0, h0 + heads_per_item) are contiguous in q */
                const int64_t q_off = (int64_t)t * q_stride + (int64_t)h0 * group * hd;
                for (size_t i = 0; i < rows; ++i) {
                    const float *qr = row_f32(q, q_off + (int64_t)i * hd, hd, dtype, buf);
                    for (int d = 0; d < hd; ++d) qs[i * hd + d] = qr[d] * scale;
                }
                /* bfloat16: the query rows as they are, for the bfloat16 dot products */
                const uint16_t *qb = dtype == KILN_F32 ? NULL : (const uint16_t *)q + q_off;
                attend_token_hd(qs, qb, scale, k_cache, v_cache, blocks, block_size, k1, h0,
                                heads_per_item, slot_stride, group, c->kv_dtype, scores, o, buf,
                                sums,
                                slots, k0, maxima, softcap, hd);
                if (parts > 1) continue;
                const int64_t o_off = (int64_t)t * out_stride + (int64_t)h0 * group * hd;
                for (size_t i = 0; i < rows; ++i)
                    store_row(out, o_off + (int64_t)i * hd, acc + i * hd, v_scale / denom[i],
                              hd, dtype);
            }
        }
        if (parts > 1) { /* after the loop's barrier: every part is in */
            int skip;
#pragma omp atomic read
            skip = any_failed;
#pragma omp for schedule(static)
            for (int64_t item = 0; item < items; ++item) {
                if (skip || !acc) continue;
                const int r = reqs[item / per_req], h0 = (int)(item % per_req) * heads_per_item;
                const int64_t o_off = (int64_t)query_start[r] * out_stride +
                                      (int64_t)h0 * group * hd;
                merge_parts(partial + item * parts * unit_floats, parts, rows, hd, acc, out, o_off,
                            v_scale, dtype);
            }
        }
        free(scores);
        free(qs);
        free(acc);
        free(buf);
        free(denom);
        free(mx);
        free(slots);
    }
    free(partial);
    return failed; /* KILN_ATTN_BAD_LENGTHS and/or KILN_ATTN_NO_MEMORY */
}


/* One layer's attention for a step: its new keys and values into the cache, then the selected
 * requests' queries against their context (its last `window` keys where window > 0; scores
 * soft-capped at softcap where > 0). One call per layer, since crossing from
 * Python costs more than a decode's work here. Returns 0, or bits: 1 a seq_len above
 * max_seq_len or below its query length, 2 out of memory, 4 a slot outside the cache (then
 * nothing is written), 8 bad head counts. */
int kiln_paged_attention(const void *q, int64_t q_stride, const void *k, int64_t k_stride,
                         const void *v, int64_t v_stride, void *out, int64_t out_stride,
                         int32_t num_heads, float scale, int32_t window, float softcap,
                         const KilnKvCache *cache, const KilnAttnStep *step,
                         int32_t num_threads) {
    const int rc = kiln_kv_cache_write(k, k_stride, v, v_stride, cache, step,
                                         num_threads);
    if (rc || step->num_sel == 0) return rc;
    return attend(q, q_stride, out, out_stride, num_heads, scale, window, softcap, cache, step,
                  num_threads);
}
