/* What the AMX tile kernels (int8_amx_panels.c, prefill_amx.c) share: the tile configuration every
 * thread loads before its first tile instruction, and the 16 x 16 dword transpose that turns
 * 16 rows of a matrix into a B tile's VNNI layout (a row per dword of k, one column per row).
 * Whether this process may use the tiles at all is kiln_amx_ready() (amx.c). */
#ifndef KILN_AMX_H
#define KILN_AMX_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AMX_TILE__)
#include <immintrin.h>
#define KILN_AMX_TILES 1

/* Every tile 16 rows x 64 bytes: A and B tiles of 64 bytes of k, C tiles of 16 x 16 int32 or
 * float32. A constant in memory: GCC drops stores into a stack copy that only ldtilecfg reads. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) KilnTileConfig;

static const KilnTileConfig KILN_AMX_CONFIG = {
    1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

static inline void kiln_amx_configure(void) { _tile_loadconfig(&KILN_AMX_CONFIG); }

/* The 16 x 16 dword transpose of r, in place: r[c] becomes dword c of every input row. */
static inline void kiln_transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* u[i + j]: dword 4L + j of rows i..i+3, in lane L */
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int j = 0; j < 4; ++j) { /* the 4 x 4 transpose of 128-bit lanes */
        const __m512i s0 = _mm512_shuffle_i32x4(u[j], u[4 + j], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i s1 = _mm512_shuffle_i32x4(u[j], u[4 + j], _MM_SHUFFLE(3, 2, 3, 2));
        const __m512i s2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i s3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(3, 2, 3, 2));
        r[j] = _mm512_shuffle_i32x4(s0, s2, _MM_SHUFFLE(2, 0, 2, 0));
        r[4 + j] = _mm512_shuffle_i32x4(s0, s2, _MM_SHUFFLE(3, 1, 3, 1));
        r[8 + j] = _mm512_shuffle_i32x4(s1, s3, _MM_SHUFFLE(2, 0, 2, 0));
        r[12 + j] = _mm512_shuffle_i32x4(s1, s3, _MM_SHUFFLE(3, 1, 3, 1));
    }
}
#else
#define KILN_AMX_TILES 0
#endif

#endif
