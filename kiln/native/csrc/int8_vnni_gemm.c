/* The W8A8 GEMM on AVX512-VNNI over the weight in panels of 64 columns (kiln/ir/int8_panels.py's
 * layout): packed once at load (kiln_int8_gemm_packed, every row count) or per call
 * (kiln_int8_gemm_panels, many rows of a weight kept as stored). Register tiles of 6 rows x 64
 * columns and the epilogue from registers: the int32 sums never go to memory, no weight byte is
 * offset and no sum reduced across lanes per call. Where the CPU grants AMX-INT8 tiles, from
 * kiln_int8_amx_min_rows() rows the same panels go to int8_amx_panels.c instead. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "int8_simd.h"
#include "kernels.h"

#if KILN_INT8_SIMD

#define NR 4 /* zmm of 16 columns a register tile */
#define PANEL (16 * NR) /* columns a panel */
#define MR 6 /* rows a register tile: 24 accumulators, 4 weight vectors */
#define TILE_M 96 /* rows a task: its activations stay in L2 while it walks a panel */
/* How far ahead of its reads a tile prefetches the panel, into L2: a decode step reads each
 * weight once, from memory, and the hardware prefetchers alone left a row or two short of the
 * DRAM bandwidth. */
#define PREFETCH_BYTES 4096

/* Panel p of w (int8 [n, k], row stride w_stride) as the micro-kernel reads it: per 4 k, the
 * panel's 64 columns' 4 bytes each, plus 128 (u8: VNNI multiplies u8 by s8); columns past n are
 * zero, and contribute nothing. */
static void pack_panel(const int8_t *w, int64_t w_stride, int64_t n, int64_t k, int64_t p,
                       uint8_t *dst) {
    const int64_t c0 = p * PANEL, cols = n - c0 < PANEL ? n - c0 : PANEL;
    uint32_t *out = (uint32_t *)dst; /* [k / 4][PANEL] words of 4 bytes */
    for (int64_t g = 0; g < k / 4; ++g) {
        for (int64_t c = 0; c < cols; ++c) {
            uint32_t four;
            memcpy(&four, w + (c0 + c) * w_stride + 4 * g, 4);
            out[g * PANEL + c] = four ^ 0x80808080u;
        }
        for (int64_t c = cols; c < PANEL; ++c) out[g * PANEL + c] = 0;
    }
}

/* Row r's step of the sums (R <= MR, a constant at each call: unrolled, the accumulators named
 * one by one so that they all stay in registers). */
#define DOT(r)                                                                                  \
    do {                                                                                        \
        if (R > r) {                                                                            \
            const __m512i av = _mm512_set1_epi32(*(const int32_t *)(a + r * a_stride + 4 * g)); \
            c##r##0 = _mm512_dpbusd_epi32(c##r##0, b0, av);                                     \
            c##r##1 = _mm512_dpbusd_epi32(c##r##1, b1, av);                                     \
            c##r##2 = _mm512_dpbusd_epi32(c##r##2, b2, av);                                     \
            c##r##3 = _mm512_dpbusd_epi32(c##r##3, b3, av);                                     \
        }                                                                                       \
    } while (0)
/* Row r's epilogue straight from its four accumulators. */
#define EPILOGUE(r)                                                                             \
    do {                                                                                        \
        if (R > r) {                                                                            \
            const __m512 sa = _mm512_set1_ps(a_scale[r]);                                       \
            char *row = (char *)out + r * out_stride * es;                                      \
            if (c0 + PANEL <= n) {                                                              \
                store32(row, c0, scaled16_of(c##r##0, sa, ws[0], bs[0], has_bias),              \
                        scaled16_of(c##r##1, sa, ws[1], bs[1], has_bias), out_dtype);           \
                store32(row, c0 + 32, scaled16_of(c##r##2, sa, ws[2], bs[2], has_bias),         \
                        scaled16_of(c##r##3, sa, ws[3], bs[3], has_bias), out_dtype);           \
            } else {                                                                            \
                const __m512i v[NR] = {c##r##0, c##r##1, c##r##2, c##r##3};                     \
                int j = 0;                                                                      \
                for (; j + 1 < NR && c0 + 16 * j + 32 <= n; j += 2)                             \
                    store32(row, c0 + 16 * j, scaled16_of(v[j], sa, ws[j], bs[j], has_bias),    \
                            scaled16_of(v[j + 1], sa, ws[j + 1], bs[j + 1], has_bias),          \
                            out_dtype);                                                         \
                for (; j < NR && c0 + 16 * j < n; ++j)                                          \
                    store16(row, c0 + 16 * j, scaled16_of(v[j], sa, ws[j], bs[j], has_bias),    \
                            out_dtype, lanes[j]);                                               \
            }                                                                                   \
        }                                                                                       \
    } while (0)

/* rows [0, R) x one panel (columns from c0): the sums less each row's offset (its accumulators
 * start at -offset[r], which wraps as the sums do: the same int32 as subtracting after), then the
 * epilogue from the same registers; next_rows rows of `next` (from the byte at next, next_bytes
 * of each) prefetched for writing. The output of a prefill chunk (MBs) is not in cache: each
 * store missed, and a tile's 12-24 lines fetched for ownership while its stores waited cost 10%
 * of the GEMM's time, which fetching the next tile's lines during this one's sums hides.
 * The panel's scales and bias are loaded after the K loop: loaded before (or hoisted out of the
 * caller's row loop) they held registers the 24 accumulators need, and passing the sums through
 * an array in memory cost ~4% (docs/measurements.md). */
static inline __attribute__((always_inline)) void tile(
    const int R, const int8_t *a, int64_t a_stride, const float *a_scale, const int32_t *offset,
    const uint8_t *panel, int64_t k, const float *w_scale, const void *bias, int bias_dtype,
    void *out, int64_t out_stride, int64_t c0, int64_t n, int out_dtype, const char *next,
    int64_t next_rows, int64_t next_bytes) {
    const size_t es = elem_size(out_dtype);
    for (int64_t i = 0; i < next_rows; ++i)
        for (int64_t byte = 0; byte < next_bytes; byte += 64)
            _mm_prefetch(next + i * out_stride * es + byte, _MM_HINT_ET0);
#define START(r) _mm512_set1_epi32(R > r ? (int32_t)(0u - (uint32_t)offset[r]) : 0)
    const __m512i z0 = START(0), z1 = START(1), z2 = START(2), z3 = START(3), z4 = START(4);
    const __m512i z5 = START(5);
#undef START
    __m512i c00 = z0, c01 = z0, c02 = z0, c03 = z0, c10 = z1, c11 = z1, c12 = z1, c13 = z1;
    __m512i c20 = z2, c21 = z2, c22 = z2, c23 = z2, c30 = z3, c31 = z3, c32 = z3, c33 = z3;
    __m512i c40 = z4, c41 = z4, c42 = z4, c43 = z4, c50 = z5, c51 = z5, c52 = z5, c53 = z5;
    for (int64_t g = 0; g < k / 4; ++g) {
        const uint8_t *bp = panel + g * 4 * PANEL;
        for (int line = 0; line < 4; ++line)
            _mm_prefetch((const char *)bp + PREFETCH_BYTES + 64 * line, _MM_HINT_T1);
        const __m512i b0 = _mm512_load_si512((const void *)bp);
        const __m512i b1 = _mm512_load_si512((const void *)(bp + 64));
        const __m512i b2 = _mm512_load_si512((const void *)(bp + 128));
        const __m512i b3 = _mm512_load_si512((const void *)(bp + 192));
        DOT(0);
        DOT(1);
        DOT(2);
        DOT(3);
        DOT(4);
        DOT(5);
    }
    __m512 ws[NR], bs[NR];
    __mmask16 lanes[NR];
    const int has_bias = bias != NULL;
    for (int j = 0; j < NR; ++j) {
        lanes[j] = c0 + 16 * j < n ? tail16(n - c0 - 16 * j) : 0;
        ws[j] = _mm512_maskz_loadu_ps(lanes[j], w_scale + c0 + 16 * j);
        bs[j] = bias ? load16(bias, c0 + 16 * j, bias_dtype, lanes[j]) : _mm512_setzero_ps();
    }
    EPILOGUE(0);
    EPILOGUE(1);
    EPILOGUE(2);
    EPILOGUE(3);
    EPILOGUE(4);
    EPILOGUE(5);
}
#undef DOT
#undef EPILOGUE

/* kiln_int8_gemm's contract (int8_ops.c) with the weight as `panels` (uint8 [ceil(n / 64), k / 4,
 * 64, 4], 64-byte aligned), k a multiple of 4; 1 otherwise. */
int kiln_int8_gemm_packed(const int8_t *a, int64_t a_stride, const float *a_scale,
                          const uint8_t *panels, const float *w_scale, const void *bias,
                          int32_t bias_dtype, void *out, int64_t out_stride, int64_t m, int64_t n,
                          int64_t k, int32_t out_dtype, int32_t num_threads) {
    if (k % 4 || k < 0) return 1;
    if (m == 0 || n == 0) return 0;
    const int64_t amx_rows = kiln_int8_amx_min_rows();
    if (amx_rows && m >= amx_rows && k > 0)
        return kiln_int8_gemm_amx_panels(a, a_stride, a_scale, panels, w_scale, bias, bias_dtype,
                                         out, out_stride, m, n, k, out_dtype, num_threads);
    const int64_t panel_count = (n + PANEL - 1) / PANEL, tiles = (m + TILE_M - 1) / TILE_M;
    const int64_t panel_bytes = k * PANEL;
    int32_t *sums = (int32_t *)malloc((size_t)m * sizeof(int32_t));
    if (!sums) return 2;
    const size_t es = elem_size(out_dtype);
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; ++r) sums[r] = row_offset(a + r * a_stride, k);
        /* rows [r, end) x panel p, register tile by register tile; with `ahead`, each tile
         * prefetches the next one's output: the next rows of [r0, end) in this panel, after
         * the last the first of the next panel (a thread's next task under the static
         * schedules below) */
#define TILE(R)                                                                                 \
    tile(R, a + r * a_stride, a_stride, a_scale + r, sums + r, panels + p * panel_bytes, k,     \
         w_scale, bias, bias_dtype, (char *)out + r * out_stride * es, out_stride, p * PANEL, n, \
         out_dtype, (const char *)out + (next_r * out_stride + next_p * PANEL) * es, next_rows, \
         next_bytes)
#define TILES(r0, end, ahead)                                                                   \
    for (int64_t r = (r0); r < (end); r += MR) {                                                \
        const int64_t next_r = r + MR < (end) ? r + MR : (r0);                                  \
        const int64_t next_p = r + MR < (end) ? p : p + 1;                                      \
        const int64_t next_rows = !(ahead) || next_p >= panel_count ? 0                         \
                                  : (end) - next_r < MR ? (end) - next_r : MR;                  \
        const int64_t next_bytes =                                                              \
            (n - next_p * PANEL < PANEL ? n - next_p * PANEL : PANEL) * (int64_t)es;            \
        switch ((end) - r < MR ? (end) - r : MR) {                                              \
            case 6: TILE(6); break;                                                             \
            case 5: TILE(5); break;                                                             \
            case 4: TILE(4); break;                                                             \
            case 3: TILE(3); break;                                                             \
            case 2: TILE(2); break;                                                             \
            default: TILE(1); break;                                                            \
        }                                                                                       \
    }
        if (tiles == 1 && num_threads > 1) {
            /* one row tile (a decode step): tasks of one register tile x one panel, in panel
             * order, so that a few panels split evenly (o's and down's 9 went 5 / 4 to two
             * threads); each row's sums are the same whichever rows share its register tile */
            const int64_t row_tiles = (m + MR - 1) / MR;
#pragma omp for schedule(static)
            for (int64_t task = 0; task < panel_count * row_tiles; ++task) {
                const int64_t p = task / row_tiles, r0 = task % row_tiles * MR;
                TILES(r0, r0 + MR < m ? r0 + MR : m, 0);
            }
        } else {
#pragma omp for collapse(2) schedule(static)
            for (int64_t t = 0; t < tiles; ++t)
                for (int64_t p = 0; p < panel_count; ++p)
                    TILES(t * TILE_M, (t + 1) * TILE_M < m ? (t + 1) * TILE_M : m, 1);
        }
#undef TILES
#undef TILE
    }
    free(sums);
    return 0;
}

/* kiln_int8_gemm's contract (int8_ops.c), for k a multiple of 4 (1 otherwise), the weight packed
 * for this call; 2 out of memory. */
int kiln_int8_gemm_panels(const int8_t *a, int64_t a_stride, const float *a_scale,
                          const int8_t *w, int64_t w_stride, const float *w_scale,
                          const void *bias, int32_t bias_dtype, void *out, int64_t out_stride,
                          int64_t m, int64_t n, int64_t k, int32_t out_dtype,
                          int32_t num_threads) {
    if (k % 4 || k <= 0) return 1;
    if (m == 0 || n == 0) return 0;
    const int64_t panel_count = (n + PANEL - 1) / PANEL, panel_bytes = k * PANEL;
    uint8_t *packed = (uint8_t *)aligned_alloc(64, (size_t)(panel_count * panel_bytes));
    if (!packed) return 2;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < panel_count; ++p)
        pack_panel(w, w_stride, n, k, p, packed + p * panel_bytes);
    const int rc = kiln_int8_gemm_packed(a, a_stride, a_scale, packed, w_scale, bias, bias_dtype,
                                         out, out_stride, m, n, k, out_dtype, num_threads);
    free(packed);
    return rc;
}

#else

int kiln_int8_gemm_packed(const int8_t *a, int64_t a_stride, const float *a_scale,
                          const uint8_t *panels, const float *w_scale, const void *bias,
                          int32_t bias_dtype, void *out, int64_t out_stride, int64_t m, int64_t n,
                          int64_t k, int32_t out_dtype, int32_t num_threads) {
    return 4;
}

int kiln_int8_gemm_panels(const int8_t *a, int64_t a_stride, const float *a_scale,
                          const int8_t *w, int64_t w_stride, const float *w_scale,
                          const void *bias, int32_t bias_dtype, void *out, int64_t out_stride,
                          int64_t m, int64_t n, int64_t k, int32_t out_dtype,
                          int32_t num_threads) {
    return 4;
}

#endif
