/* out [m, n] = x [m, k] @ w [n, k]^T in bfloat16 on AMX-BF16 tiles, the weight read as stored (no
 * packed copy): the float MoE experts' GEMMs above the GEMV kernel's rows (moe_experts.cpp).
 *
 * The product is taken transposed, out^T = w . x^T, so that 16 rows x 32 k of the weight are an
 * A tile exactly as they lie in memory (a strided tile load, nothing packed); x^T, small, is
 * packed once a call into B tiles (each dword a pair of k, one column per row of x: amx.h's
 * 16 x 16 dword transpose of 16 rows of x). A thread takes 32 weight rows at a time (two A
 * tiles) against 32 rows of x (two B tiles, four C tiles), so a few rows of x stream the weight
 * once and many reuse each A tile from cache. float32 sums, rounded once to bfloat16 as oneDNN's
 * GEMM rounds them (dtype.h's store_bf16x32). Weight rows and k past a tile's edge are read
 * through a zero-padded copy of that tile (never past the weight). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "dtype.h"
#include "kernels.h"

#if KILN_AMX_TILES && defined(__AMX_BF16__) && defined(__AVX512BF16__)

#define TK 32     /* bfloat16 k per tile row (64 bytes) */
#define TILE 1024 /* bytes in a tile */

int kiln_bf16_amx_gemm_ready(void) { return kiln_amx_ready(); }

/* B tile (mb, s) of x^T: row j holds k pair (32 s + 2 j, + 1) of x rows 16 mb .. 16 mb + 15, one
 * dword each; rows of x past m and k past k are zeros. */
static void pack_x_tile(const uint16_t *x, int64_t m, int64_t k, int64_t mb, int64_t s,
                        uint8_t *tile) {
    const int64_t k0 = s * TK, left = k - k0 < TK ? k - k0 : TK;
    const __mmask32 mask = left == TK ? ~(__mmask32)0 : (((__mmask32)1 << left) - 1);
    __m512i r[16];
    for (int i = 0; i < 16; ++i) {
        const int64_t row = mb * 16 + i;
        r[i] = row < m ? _mm512_maskz_loadu_epi16(mask, x + row * k + k0) : _mm512_setzero_si512();
    }
    kiln_transpose16(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(tile + 64 * i, r[i]);
}

/* A tile (rows row0 .. row0 + 15, k step s) into dst, 64 bytes a row: the rows and k that exist,
 * zeros elsewhere. */
static void copy_a_tile(const uint16_t *w, int64_t n, int64_t k, int64_t row0, int64_t s,
                        uint8_t *dst) {
    const int64_t k0 = s * TK, left = k - k0 < TK ? k - k0 : TK;
    const __mmask32 mask = left == TK ? ~(__mmask32)0 : (((__mmask32)1 << left) - 1);
    for (int i = 0; i < 16; ++i)
        _mm512_storeu_si512(dst + 64 * i, row0 + i < n
                                              ? _mm512_maskz_loadu_epi16(mask, w + (row0 + i) * k + k0)
                                              : _mm512_setzero_si512());
}

/* Where A tile (row0, s) loads from: the weight itself (*stride its row bytes), or `pad` holding
 * a copy (copy_a_tile) where the tile reaches past the weight's rows or k. */
static inline const void *a_tile(const uint16_t *w, int64_t n, int64_t k, int64_t row0, int64_t s,
                                 uint8_t *pad, int64_t *stride) {
    if (row0 + 16 <= n && s * TK + TK <= k) {
        *stride = k * 2;
        return w + row0 * k + s * TK;
    }
    copy_a_tile(w, n, k, row0, s, pad);
    *stride = 64;
    return pad;
}

/* c[t] (C tile t: 16 weight rows x 16 x rows, float32) -> out rows mb * 16 .. of weight rows
 * n0 .. n0 + 31 (tiles 2 h + 0 for n0 .. n0 + 15, 2 h + 1 for the next 16; h the x block). */
static void store_block(float (*c)[256], int h, int64_t mb, int64_t m, int64_t n0, int64_t n,
                        uint16_t *out, int64_t ldo) {
    __m512i lo[16], hi[16];
    for (int i = 0; i < 16; ++i) {
        lo[i] = _mm512_loadu_si512(c[2 * h] + 16 * i);
        hi[i] = _mm512_loadu_si512(c[2 * h + 1] + 16 * i);
    }
    kiln_transpose16(lo); /* lo[j]: x row 16 mb + j's products with weight rows n0 .. n0 + 15 */
    kiln_transpose16(hi);
    for (int j = 0; j < 16 && mb * 16 + j < m; ++j) {
        uint16_t *dst = out + (mb * 16 + j) * ldo + n0;
        const __m512 a = (__m512)lo[j], b = (__m512)hi[j];
        if (n0 + 32 <= n && store_bf16x32(dst, a, b)) continue;
        float v[32]; /* an edge of the weight, or a subnormal among them */
        _mm512_storeu_ps(v, a);
        _mm512_storeu_ps(v + 16, b);
        for (int e = 0; e < 32 && n0 + e < n; ++e) dst[e] = f32_to_bf16(v[e]);
    }
}

/* Weight rows n0 .. n0 + 31 against every row of x (B tiles xt, `steps` a block of x). Where
 * more than 32 rows of x reuse them, the block's A tiles are first copied into `pack` (tile after
 * tile, [step][2]): loaded in place, 32 weight rows a whole row of k apart fall into few L1 sets
 * and evict each other between the passes (measured: the copy made 128 rows ~1.5x faster). */
static void row_block(const uint16_t *w, int64_t n, int64_t k, int64_t n0, const uint8_t *xt,
                      int64_t m, int64_t steps, uint16_t *out, int64_t ldo, uint8_t *pad,
                      uint8_t *pack, float (*c)[256]) {
    const int64_t mbs = (m + 15) / 16;
    if (pack)
        for (int64_t s = 0; s < steps; ++s) {
            copy_a_tile(w, n, k, n0, s, pack + 2 * s * TILE);
            copy_a_tile(w, n, k, n0 + 16, s, pack + (2 * s + 1) * TILE);
        }
    for (int64_t mb = 0; mb < mbs; mb += 2) {
        const int two = mb + 1 < mbs;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const uint8_t *b0 = xt + mb * steps * TILE, *b1 = b0 + steps * TILE;
        for (int64_t s = 0; s < steps; ++s) {
            if (pack && mb == 0) /* the next block's rows into L2 while these compute */
                for (int64_t i = n0 + 32; i < n0 + 64 && i < n; ++i)
                    _mm_prefetch((const char *)(w + i * k + s * TK), _MM_HINT_T1);
            if (pack) {
                _tile_loadd(4, pack + 2 * s * TILE, 64);
                _tile_loadd(5, pack + (2 * s + 1) * TILE, 64);
            } else {
                int64_t st0, st1;
                const void *a0 = a_tile(w, n, k, n0, s, pad, &st0);
                const void *a1 = a_tile(w, n, k, n0 + 16, s, pad + TILE, &st1);
                _tile_loadd(4, a0, st0);
                _tile_loadd(5, a1, st1);
            }
            _tile_loadd(6, b0 + s * TILE, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 5, 6);
            if (two) {
                _tile_loadd(7, b1 + s * TILE, 64);
                _tile_dpbf16ps(2, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        store_block(c, 0, mb, m, n0, n, out, ldo);
        if (two) {
            _tile_stored(2, c[2], 64);
            _tile_stored(3, c[3], 64);
            store_block(c, 1, mb + 1, m, n0, n, out, ldo);
        }
    }
}

int kiln_bf16_amx_gemm(const void *x, const void *w, void *out, int64_t ldo, int64_t m, int64_t n,
                       int64_t k, int32_t num_threads) {
    if (m < 1 || n < 1 || k < 1 || ldo < n || !kiln_amx_ready()) return 1;
    const int64_t steps = (k + TK - 1) / TK, mbs = (m + 15) / 16, blocks = (n + 31) / 32;
    uint8_t *xt = (uint8_t *)aligned_alloc(64, (size_t)(mbs * steps * TILE)); /* [x block][step] */
    if (!xt) return 2;
    const uint16_t *xp = (const uint16_t *)x, *wp = (const uint16_t *)w;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < mbs * steps; ++t) pack_x_tile(xp, m, k, t / steps, t % steps,
                                                             xt + t * TILE);
        uint8_t pad[2 * TILE] __attribute__((aligned(64)));
        float c[4][256] __attribute__((aligned(64)));
        /* (no memory for it: the tiles load in place) */
        uint8_t *pack = m > 32 ? (uint8_t *)aligned_alloc(64, (size_t)(2 * steps * TILE)) : NULL;
        kiln_amx_configure();
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; ++b)
            row_block(wp, n, k, 32 * b, xt, m, steps, (uint16_t *)out, ldo, pad, pack, c);
        _tile_release();
        free(pack);
    }
    free(xt);
    return 0;
}

#else /* built without AMX-BF16 tiles: the callers take aten's GEMM */

int kiln_bf16_amx_gemm_ready(void) { return 0; }
int kiln_bf16_amx_gemm(const void *x, const void *w, void *out, int64_t ldo, int64_t m, int64_t n,
                       int64_t k, int32_t num_threads) {
    return 1;
}
#endif
