/* The prefill attention kernel's portable path (prefill_attention.c): one (token, head) at a
 * time, keys in blocks, the AVX512 tiles' rounding points. */
#ifndef KILN_PREFILL_SCALAR_H
#define KILN_PREFILL_SCALAR_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "dtype.h"
#include "prefill_tiles.h"
#include "prefill_unit.h"

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

#endif
