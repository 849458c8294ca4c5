/* The prefill kernel's AVX512-BF16 tiles' keys gathered once a call, by the first unit to reach
 * each key block: a request's K rows and V key pairs per kv head (fp8 dequantized), contiguous. */
#ifndef KILN_PREFILL_GATHER_H
#define KILN_PREFILL_GATHER_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"
#include "paged_attention.h"
#include "prefill_tiles.h"
#include "prefill_unit.h"

/* The call's gathered rows at most (past it, the units read the cache as they find it: a
 * buffer this large is mapped and its pages faulted in anew every call). */
#define PF_GATHER_MAX_BYTES ((int64_t)64 << 20)

/* Keys a request's gathered rows hold: its seq_len rounded up to whole score tiles (the tiles
 * read up to PF_KEYS - 1 zero keys past the last). */
static inline int64_t gather_keys(int seq_len) {
    return ((int64_t)seq_len + PF_KEYS - 1) / PF_KEYS * PF_KEYS;
}

/* Bytes of a request's gathered K rows and V pairs for one kv head (both bfloat16). */
static inline int64_t gather_bytes(int seq_len, int hd) { return gather_keys(seq_len) * hd * 4; }

/* Keys kb .. kb + PF_SBK (or the request's last) of one kv head, from the cache into the request's
 * gathered rows at g: K [keys][hd] bfloat16, then V [keys / 2][hd] words. kb: a multiple of
 * PF_SBK (so of 2). */
static inline void gather_block(const Call *c, const int32_t *blocks, int kv_head, int seq_len,
                                int kb, uint16_t *g, Scratch *w) {
    const int hd = c->hd, nkr = (int)gather_keys(seq_len);
    const int nk = seq_len - kb < PF_SBK ? seq_len - kb : PF_SBK;
    const int nkp = nkr - kb < PF_SBK ? nkr - kb : PF_SBK; /* zero keys up to nkr */
    key_rows(c, blocks, kv_head, kb, nk, nkp, w);
    for (int j = 0; j < nkp; ++j) memcpy(g + (int64_t)(kb + j) * hd, w->kp[j], (size_t)hd * 2);
    pack_value_pairs(w->vp, nkp / 2, hd, (int32_t *)(g + (int64_t)nkr * hd) + (int64_t)kb / 2 * hd);
}

/* Whether request r's keys are gathered: a query of 3 units of 16 tokens or more over 256 keys
 * or more (measured with a gathering phase before the units: 2 units over 2000 keys were 7%
 * slower gathered, 3 4% faster; 32 x 64 tokens 3% slower, 4 x 512 8-9% faster). */
static inline int gathers(const KilnAttnStep *st, int r) {
    return st->query_start[r + 1] - st->query_start[r] > 32 && st->seq_lens[r] >= 4 * PF_SBK;
}

/* The call's gathered rows, requests in st's order, kv heads within (NULL where there are none:
 * nothing to gather, the cap passed, no memory), and *state, one word a key block of each
 * (request, kv head), 0: not gathered yet (take_block's). */
static inline uint16_t *plan_gather(const KilnAttnStep *st, int nkv, int hd, int **state) {
    int64_t bytes = 0, n = 0;
    for (int i = 0; i < st->num_sel; ++i) {
        const int r = st->reqs[i];
        if (!gathers(st, r)) continue;
        bytes += gather_bytes(st->seq_lens[r], hd) * nkv;
        n += (int64_t)(st->seq_lens[r] + PF_SBK - 1) / PF_SBK * nkv;
    }
    *state = NULL;
    if (n == 0 || bytes > PF_GATHER_MAX_BYTES) return NULL;
    uint16_t *rows = (uint16_t *)malloc((size_t)bytes);
    int *s = (int *)calloc((size_t)n, sizeof(int));
    if (!rows || !s) {
        free(rows), free(s);
        return NULL;
    }
    *state = s;
    return rows;
}

/* Whether key block kb of the unit's (request, kv head) is in its gathered rows g: the first
 * unit to reach a block gathers it (no thread waits on another: a unit finding it under way
 * reads the cache itself), so the units that overlap it afterwards read it from g. */
static inline int take_block(const Call *c, const Unit *u, int kb, uint16_t *g, Scratch *w) {
    int *state = c->gather_state + u->task0 + kb / PF_SBK;
    int s = __atomic_load_n(state, __ATOMIC_ACQUIRE);
    if (s == 0 &&
        __atomic_compare_exchange_n(state, &s, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        gather_block(c, c->block_table + (int64_t)u->req * c->bt_stride, u->kv_head,
                     c->seq_lens[u->req], kb, g, w);
        __atomic_store_n(state, 2, __ATOMIC_RELEASE);
        return 1;
    }
    return s == 2;
}

#endif
