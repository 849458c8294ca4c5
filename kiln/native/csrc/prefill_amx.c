/* The prefill attention kernel's bfloat16 path on AMX-BF16 tiles: a unit (prefill_unit.h) as
 * unit_simd computes it, Q.K^T and P.V as tile products, the online softmax in float32 between
 * them, probabilities rounded to bfloat16 before P.V (as SDPA and the AVX512-BF16 path do).
 *
 * Rows are tokens throughout, as the tiles want them: a row group (16 tokens of one query head)
 * is an A tile of Q read in place (a padded copy for a short group), its scores a 16 x 32 block,
 * its outputs [16][hd] in float32. K enters as B tiles, a 16 x 16 dword transpose of 16 key rows
 * per tile (dims in pairs, keys across), packed once per key block for every head of the group
 * (GQA); V's pairs of keys (unit_simd's vpk) are already a B tile's layout.
 *
 * Layouts in Scratch: qp the padded Q rows; s [16][PF_BK] scores per row group; pp [16][PF_BK]
 * bfloat16 probabilities; o [16][hd]; m, l per token; kt the K tiles, then one [16][hd] block of
 * P.V sums. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "amx.h"
#include "dtype.h"
#include "kernels.h"
#include "prefill_tiles.h"
#include "prefill_unit.h"

#if KILN_AMX_TILES && defined(__AMX_BF16__) && KILN_PREFILL_BF16_SIMD

#define TILE 1024 /* bytes in a tile */
#define DIMS 32   /* bfloat16 dims of a k step */

int prefill_amx_serves(int dtype, int hd) {
    return dtype == KILN_BF16 && hd % DIMS == 0 && kiln_amx_ready();
}

void prefill_amx_begin(void) { kiln_amx_configure(); }
void prefill_amx_end(void) { _tile_release(); }

/* The key block's K as B tiles, [key tile][k step]: row r of a tile holds dims (2r, 2r + 1) of
 * each of its 16 keys. */
static void pack_keys(const void *const *kp, int hd, int8_t *kt) {
    for (int t = 0; t < PF_BK / 16; ++t)
        for (int s = 0; s < hd / DIMS; ++s) {
            __m512i r[16];
            for (int j = 0; j < 16; ++j)
                r[j] = _mm512_loadu_si512((const uint16_t *)kp[16 * t + j] + s * DIMS);
            kiln_transpose16(r);
            int8_t *tile = kt + (t * (hd / DIMS) + s) * TILE;
            for (int i = 0; i < 16; ++i) _mm512_storeu_si512(tile + 64 * i, r[i]);
        }
}

/* The online softmax over one key block of a row group, rows = tokens: scores scaled and masked
 * past each token's position, running maxima m and sums l, outputs o rescaled, probabilities
 * into pp as bfloat16. */
static void softmax_rows(const Call *c, float *s, int kb, const int *pos, float scale, float *m,
                         float *l, float *o, int hd, uint16_t *pp) {
    const __m512 vscale = _mm512_set1_ps(scale), masked = _mm512_set1_ps(MASKED);
    const __m512i lo = _mm512_add_epi32(_mm512_set1_epi32(kb),
                                        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                          12, 13, 14, 15));
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(16));
    for (int i = 0; i < 16; ++i) {
        const __m512i p = _mm512_set1_epi32(pos[i]);
        __m512 x0 = _mm512_mul_ps(_mm512_loadu_ps(s + PF_BK * i), vscale);
        __m512 x1 = _mm512_mul_ps(_mm512_loadu_ps(s + PF_BK * i + 16), vscale);
        if (c->softcap > 0.f) {
            _mm512_storeu_ps(s + PF_BK * i, x0);
            _mm512_storeu_ps(s + PF_BK * i + 16, x1);
            soft_cap(c, s + PF_BK * i, 32);
            x0 = _mm512_loadu_ps(s + PF_BK * i);
            x1 = _mm512_loadu_ps(s + PF_BK * i + 16);
        }
        x0 = _mm512_mask_mov_ps(x0, _mm512_cmpgt_epi32_mask(lo, p), masked);
        x1 = _mm512_mask_mov_ps(x1, _mm512_cmpgt_epi32_mask(hi, p), masked);
        if (kb < first_key(c, pos[i])) { /* keys before the row's sliding window */
            const __m512i first = _mm512_set1_epi32(first_key(c, pos[i]));
            x0 = _mm512_mask_mov_ps(x0, _mm512_cmpgt_epi32_mask(first, lo), masked);
            x1 = _mm512_mask_mov_ps(x1, _mm512_cmpgt_epi32_mask(first, hi), masked);
        }
        const float mx = fmaxf(m[i], _mm512_reduce_max_ps(_mm512_max_ps(x0, x1)));
        const __m512 vmx = _mm512_set1_ps(mx);
        const __m512 e0 = kiln_exp512(_mm512_sub_ps(x0, vmx)), e1 = kiln_exp512(_mm512_sub_ps(x1, vmx));
        if (mx != m[i]) {
            const __m512 alpha = kiln_exp512(_mm512_set1_ps(m[i] - mx));
            l[i] *= _mm512_cvtss_f32(alpha);
            for (int d = 0; d < hd; d += 16)
                _mm512_storeu_ps(o + hd * i + d, _mm512_mul_ps(_mm512_loadu_ps(o + hd * i + d), alpha));
            m[i] = mx;
        }
        l[i] += _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
        _mm256_storeu_si256((__m256i *)(pp + PF_BK * i), (__m256i)_mm512_cvtneps_pbh(e0));
        _mm256_storeu_si256((__m256i *)(pp + PF_BK * i + 16), (__m256i)_mm512_cvtneps_pbh(e1));
    }
}

/* The query head of row group rg (16 tokens of one head; heads major, token blocks minor). */
static inline int64_t head_of(const Call *c, const Unit *u, int rg) {
    return (int64_t)u->kv_head * c->group + rg / c->tb;
}

void unit_amx(const Call *c, const Unit *u, Scratch *w) {
    const int hd = c->hd, tb = c->tb, rgs = c->group * tb, steps = hd / DIMS;
    const int q_begin = c->query_start[u->req];
    const int ctx = c->seq_lens[u->req] - (c->query_start[u->req + 1] - q_begin);
    const int32_t *blocks = c->block_table + (int64_t)u->req * c->bt_stride;
    int8_t *kt = (int8_t *)w->kt;
    float *pv = (float *)(kt + PREFILL_AMX_KEY_TILES(hd));
    int pos[16 * 4]; /* each token's position; padding rows repeat the unit's last token */
    for (int i = 0; i < 16 * tb; ++i) pos[i] = ctx + (u->t0 + (i < u->nt ? i : u->nt - 1) - q_begin);
    for (int rg = 0; rg < rgs; ++rg) /* short row groups: Q rows copied, the last repeated */
        if (16 * (rg % tb) + 16 > u->nt)
            for (int i = 0; i < 16; ++i) {
                const int b = rg % tb, t = u->t0 + (16 * b + i < u->nt ? 16 * b + i : u->nt - 1);
                memcpy((uint16_t *)w->qp + ((int64_t)rg * 16 + i) * hd,
                       (const uint16_t *)c->q + (int64_t)t * c->q_stride + head_of(c, u, rg) * hd,
                       (size_t)hd * 2);
            }
    memset(w->o, 0, sizeof(float) * rgs * 16 * hd);
    for (int i = 0; i < rgs * 16; ++i) w->m[i] = MASKED, w->l[i] = 0.f;
    const int n_keys = pos[u->nt - 1] + 1;
    for (int kb = first_key(c, pos[0]); kb < n_keys; kb += PF_BK) {
        const int nk = n_keys - kb < PF_BK ? n_keys - kb : PF_BK;
        key_rows(c, blocks, u->kv_head, kb, nk, PF_BK, w);
        pack_keys(w->kp, hd, kt);
        pack_value_pairs(w->vp, PF_BK / 2, hd, w->vpk);
        for (int rg = 0; rg < rgs; ++rg) {
            float *s = w->s + rg * 16 * PF_BK, *o = w->o + (int64_t)rg * 16 * hd;
            uint16_t *pp = (uint16_t *)(w->pp + rg * 16 * PF_BK / 2);
            const int b = rg % tb, full = 16 * b + 16 <= u->nt;
            const uint16_t *q = full ? (const uint16_t *)c->q + (int64_t)(u->t0 + 16 * b) *
                                           c->q_stride + head_of(c, u, rg) * hd
                                     : (const uint16_t *)w->qp + (int64_t)rg * 16 * hd;
            const int64_t q_stride = full ? c->q_stride * 2 : (int64_t)hd * 2;
            _tile_zero(0);
            _tile_zero(1);
            for (int st = 0; st < steps; ++st) {
                _tile_loadd(4, q + st * DIMS, q_stride);
                _tile_loadd(6, kt + st * TILE, 64);
                _tile_loadd(7, kt + (steps + st) * TILE, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
            }
            _tile_stored(0, s, PF_BK * 4);
            _tile_stored(1, s + 16, PF_BK * 4);
            softmax_rows(c, s, kb, pos + 16 * (rg % tb), c->scale, w->m + rg * 16, w->l + rg * 16,
                         o, hd, pp);
            _tile_loadd(4, pp, PF_BK * 2);
            for (int d = 0; d < hd; d += 16) {
                _tile_zero(0);
                _tile_loadd(6, w->vpk + d, (int64_t)hd * 4);
                _tile_dpbf16ps(0, 4, 6);
                _tile_stored(0, pv + d, (int64_t)hd * 4);
            }
            for (int i = 0; i < 16 * hd; i += 16)
                _mm512_storeu_ps(o + i, _mm512_add_ps(_mm512_loadu_ps(o + i),
                                                      _mm512_loadu_ps(pv + i)));
        }
    }
    for (int rg = 0; rg < rgs; ++rg) {
        const int b = rg % tb;
        for (int i = 0; i < 16 && 16 * b + i < u->nt; ++i) {
            const int64_t row = (u->t0 + 16 * b + i) * c->out_stride + head_of(c, u, rg) * hd;
            const float inv = c->v_scale / w->l[rg * 16 + i];
            const float *o = w->o + ((int64_t)rg * 16 + i) * hd;
            uint16_t *dst = (uint16_t *)c->out + row; /* bfloat16: the only dtype served here */
            const __m512 vinv = _mm512_set1_ps(inv);
            for (int d = 0; d < hd; d += 32) { /* hd a multiple of 32 (prefill_amx_serves) */
                if (!store_bf16x32(dst + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), vinv),
                                   _mm512_mul_ps(_mm512_loadu_ps(o + d + 16), vinv)))
                    for (int e = 0; e < 32; ++e) /* a subnormal among them */
                        dst[d + e] = f32_to_bf16(o[d + e] * inv);
            }
        }
    }
}

#else /* built without AMX-BF16 tiles */

int prefill_amx_serves(int dtype, int hd) { return 0; }
void prefill_amx_begin(void) {}
void prefill_amx_end(void) {}
void unit_amx(const Call *c, const Unit *u, Scratch *w) {}
#endif
