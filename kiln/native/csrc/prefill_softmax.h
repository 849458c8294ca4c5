/* The online softmax of the prefill kernel's AVX512 tiles (prefill_attention.c): one key block
 * for a row group of 16 query tokens, one per lane, the layouts prefill_tiles.h's. */
#ifndef KILN_PREFILL_SOFTMAX_H
#define KILN_PREFILL_SOFTMAX_H

#include "prefill_tiles.h"
#include "prefill_unit.h"

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
 * rounded into pp in key pairs (else back into s). tile_max: the block's raw maximum per lane
 * where the score tiles took it (NULL else), used where no lane masks a key of the block and
 * no cap applies. Returns whether any alpha is not 1. */
static inline int softmax_step(const Call *c, float *s, int nkp, int kb, const int *pos,
                               __m512i lane_lo, float sscale, float *m, float *l, float *alpha,
                               int32_t *pp, const float *tile_max) {
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
    if (tile_max && !(need_mask | need_lo_mask) && c->softcap <= 0.f)
        mx = _mm512_loadu_ps(tile_max);
    else
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
#define PF_PAIR(exp2)                                                                     \
    const __m512 p0 = exp2(_mm512_fmsub_ps(_mm512_loadu_ps(s + 16 * j), sc, m_new));      \
    const __m512 p1 = exp2(_mm512_fmsub_ps(_mm512_loadu_ps(s + 16 * j + 16), sc, m_new)); \
    sum0 = _mm512_add_ps(sum0, p0), sum1 = _mm512_add_ps(sum1, p1)
#if KILN_PREFILL_BF16_SIMD
    if (pp) /* probabilities rounded to bfloat16: 2^x to that precision (3 FMAs fewer) */
        for (int j = 0; j < nkp; j += 2) {
            PF_PAIR(kiln_exp2_bf16_512);
            _mm512_storeu_si512(pp + 8 * j, pf_pair_words(p0, p1));
        }
    else
#endif
        for (int j = 0; j < nkp; j += 2) {
            PF_PAIR(kiln_exp2_512);
            _mm512_storeu_ps(s + 16 * j, p0);
            _mm512_storeu_ps(s + 16 * j + 16, p1);
        }
#undef PF_PAIR
    _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), a, _mm512_add_ps(sum0, sum1)));
    _mm512_storeu_ps(m, m_new);
    _mm512_storeu_ps(alpha, a);
    return move != 0;
}
#endif

#endif
