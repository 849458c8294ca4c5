/* The prefill kernel's AVX512 tiles' (prefill_attention.c) query and output rows: 16 tokens'
 * rows into lanes and back by 16x16 in-register transposes, the layouts prefill_tiles.h's. */
#ifndef KILN_PREFILL_ROWS_H
#define KILN_PREFILL_ROWS_H

#include "bf16_simd.h" /* bf16x16 */
#include "dtype.h"
#include "prefill_tiles.h"
#include "prefill_unit.h"

#if KILN_PREFILL_F32_SIMD
/* A row group's queries into qp (prefill_tiles.h's layout): tokens t0 + i0 .. + 15 of the unit
 * (the last repeated past its end) of head `head`, 16 dims (or bfloat16 pairs) a transpose. */
static inline void pack_queries(const Call *c, const Unit *u, int head, int i0, float *qp) {
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

/* A row group's outputs o [hd][16] / l into the out rows of tokens t0 + i0 .. (those of the unit)
 * of head `head`, 16 dims a transpose. */
static inline void store_outputs(const Call *c, const Unit *u, int head, int i0,
                                 const float *o, const float *l) {
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
#endif

#endif
