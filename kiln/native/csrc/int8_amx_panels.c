/* The W8A8 int8 GEMM on AMX-INT8 tiles over the weight in VNNI panels (kiln/ir/int8_panels.py's
 * layout, packed once at load): a panel's 16 groups of 4 k by 16 channels are a B tile as they
 * lie (rows 256 bytes apart), so the weight streams from memory in order, with no per-call
 * repack or transpose. The panels hold w + 128 (VPDPBUSD's unsigned operand), so the tiles
 * multiply signed rows by unsigned weights (TDPBSUD) and the epilogue takes back 128 x each row's
 * sum, as the VNNI panel kernel (int8_vnni_gemm.c) does: out is kiln_int8_gemm's bit for bit. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "int8_simd.h"
#include "kernels.h"

#if KILN_INT8_SIMD && KILN_AMX_TILES && defined(__AMX_INT8__)

#define PANEL 64 /* channels a panel */
#define GROUP_BYTES (PANEL * 4) /* a panel's bytes per group of 4 k: a B tile row per 16 ch */
#define HALF 32 /* channels a task: half a panel, two B tiles */
#define ROWS 32 /* rows a block of sums: two A tiles */
#define KSTEP 64 /* k a tile step: 16 groups */
/* Rows of activations a thread walks its channels over at a time (kept in L2). */
#define ROW_BLOCK 256
/* From this many rows kiln_int8_gemm_packed hands the GEMM to the tiles: below it the VNNI
 * kernel's register tiles streamed the weight faster; from here a 16-row tile pair wins. */
#define AMX_MIN_ROWS 12
/* Tasks (half panels) ahead of its reads a thread asks for the weight, into L2: a decode step
 * reads each weight once, from memory, and the tile loads alone leave the stream short of the
 * DRAM bandwidth. Two tasks on is the next panel's same half. */
#define PREFETCH_TASKS 2

/* Asks for task u's weight (half h of panel p: 2 of every 4 lines) at tile step s, into L2. */
static inline void prefetch_step(const uint8_t *panels, int64_t panel_bytes, int64_t u,
                                 int64_t s, int64_t groups) {
    const uint8_t *p = panels + (u / 2) * panel_bytes + (u % 2) * 128 + s * 16 * GROUP_BYTES;
    const int64_t g_end = groups - s * 16 < 16 ? groups - s * 16 : 16;
    for (int64_t g = 0; g < g_end; ++g) {
        _mm_prefetch((const char *)(p + g * GROUP_BYTES), _MM_HINT_T1);
        _mm_prefetch((const char *)(p + g * GROUP_BYTES + 64), _MM_HINT_T1);
    }
}

/* acc [32 rows x 32 channels] = rows a [32, ksteps * 64] (stride as) x a half panel's channels
 * b (B tile rows of 128 bytes, bstride apart: in place in the panel, or a copy). `half_rows`:
 * only a's first 16 rows (acc's rows 16-31 are then zeros). With `ahead` >= 0, task `ahead`'s
 * weight is asked for along the way. */
static inline void block_product(const int8_t *a, int64_t as, const uint8_t *b, int64_t bstride,
                                 int64_t ksteps, int half_rows, int32_t *acc,
                                 const uint8_t *panels, int64_t panel_bytes, int64_t groups,
                                 int64_t ahead) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < ksteps; ++s) {
        if (ahead >= 0) prefetch_step(panels, panel_bytes, ahead, s, groups);
        const uint8_t *bs = b + s * 16 * bstride;
        _tile_loadd(4, a + s * KSTEP, as);
        _tile_loadd(6, bs, bstride);
        _tile_loadd(7, bs + 64, bstride);
        _tile_dpbsud(0, 4, 6);
        _tile_dpbsud(1, 4, 7);
        if (!half_rows) {
            _tile_loadd(5, a + 16 * as + s * KSTEP, as);
            _tile_dpbsud(2, 5, 6);
            _tile_dpbsud(3, 5, 7);
        }
    }
    _tile_stored(0, acc, HALF * 4);
    _tile_stored(1, acc + 16, HALF * 4);
    _tile_stored(2, acc + 16 * HALF, HALF * 4);
    _tile_stored(3, acc + 16 * HALF + 16, HALF * 4);
}

/* A half panel (b: its first group's 128 bytes) as B tile rows of 128 bytes, in order, zero past
 * the groups up to whole tile steps: what a k tail reads, and what many rows read again (every
 * 32 rows re-read the half panel; read in place, 2,048 rows ran about 8% slower). */
static void copy_half(const uint8_t *b, int64_t groups, int64_t ksteps, uint8_t *dst) {
    for (int64_t g = 0; g < groups; ++g) memcpy(dst + g * 128, b + g * GROUP_BYTES, 128);
    memset(dst + groups * 128, 0, (size_t)((ksteps * 16 - groups) * 128));
}

int kiln_int8_amx_min_rows(void) { return kiln_amx_ready() ? AMX_MIN_ROWS : 0; }

/* kiln_int8_gemm_packed's contract (int8_vnni_gemm.c) on AMX tiles: 4 where there are none. */
int kiln_int8_gemm_amx_panels(const int8_t *a, int64_t a_stride, const float *a_scale,
                              const uint8_t *panels, const float *w_scale, const void *bias,
                              int32_t bias_dtype, void *out, int64_t out_stride, int64_t m,
                              int64_t n, int64_t k, int32_t out_dtype, int32_t num_threads) {
    if (!kiln_amx_ready()) return 4;
    if (k % 4 || k < 0) return 1;
    if (m == 0 || n == 0) return 0;
    const int64_t groups = k / 4, ksteps = (groups + 15) / 16, kpad = ksteps * KSTEP;
    const int64_t panel_bytes = k * PANEL, tasks = 2 * ((n + PANEL - 1) / PANEL);
    const int64_t row_blocks = (m + ROWS - 1) / ROWS;
    /* rows read in place where whole; else (a k tail, the last rows) from a zero-padded copy */
    const int in_place = k % KSTEP == 0;
    const int64_t copied_from = in_place ? m / ROWS * ROWS : 0;
    const int64_t copied = row_blocks * ROWS - copied_from;
    int32_t *sums = (int32_t *)malloc((size_t)m * sizeof(int32_t));
    int8_t *pad = copied ? (int8_t *)aligned_alloc(64, (size_t)(copied * kpad)) : NULL;
    if (!sums || (copied && !pad)) {
        free(sums);
        free(pad);
        return 2;
    }
    if (copied) {
        memset(pad, 0, (size_t)(copied * kpad));
        for (int64_t r = copied_from; r < m; ++r)
            memcpy(pad + (r - copied_from) * kpad, a + r * a_stride, (size_t)k);
    }
    const size_t oes = elem_size(out_dtype), bes = elem_size(bias_dtype);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; ++r) sums[r] = row_offset(a + r * a_stride, k);
        const int nt = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t u0 = tasks * me / nt, u1 = tasks * (me + 1) / nt;
        int32_t acc[ROWS * HALF] __attribute__((aligned(64)));
        /* a decode step's rows read each half panel once, in place; more rows, or a k tail, read
         * this thread's half panels copied in order (at the first block of rows) */
        const int copy = (m > ROW_BLOCK || groups % 16) && u1 > u0;
        const int64_t half_bytes = ksteps * 16 * 128;
        uint8_t *halves = copy ? (uint8_t *)aligned_alloc(64, (size_t)((u1 - u0) * half_bytes))
                               : NULL;
        if (copy && !halves) failed = 1;
        if (u1 > u0 && !failed) {
            kiln_amx_configure();
            for (int64_t b0 = 0; b0 < m; b0 += ROW_BLOCK) {
                const int64_t b1 = b0 + ROW_BLOCK < m ? b0 + ROW_BLOCK : m;
                if (b0 == 0) /* the first tasks' weight is on its way before their tiles */
                    for (int64_t u = u0; u < u0 + PREFETCH_TASKS && u < u1; ++u)
                        for (int64_t s = 0; s < ksteps; ++s)
                            prefetch_step(panels, panel_bytes, u, s, groups);
                for (int64_t u = u0; u < u1; ++u) {
                    const int64_t c0 = u / 2 * PANEL + u % 2 * HALF;
                    if (c0 >= n) continue; /* the unused half of a last panel of <= 32 ch */
                    const int64_t cols = n - c0 < HALF ? n - c0 : HALF;
                    const uint8_t *b = panels + u / 2 * panel_bytes + u % 2 * 128;
                    uint8_t *half = copy ? halves + (u - u0) * half_bytes : NULL;
                    if (copy && b0 == 0) copy_half(b, groups, ksteps, half);
                    const int64_t ahead = u + PREFETCH_TASKS < u1 ? u + PREFETCH_TASKS : -1;
                    for (int64_t r0 = b0; r0 < b1; r0 += ROWS) {
                        const int64_t rows = b1 - r0 < ROWS ? b1 - r0 : ROWS;
                        const int8_t *ar = r0 < copied_from ? a + r0 * a_stride
                                                            : pad + (r0 - copied_from) * kpad;
                        const int64_t as = r0 < copied_from ? a_stride : kpad;
                        block_product(ar, as, copy ? half : b, copy ? 128 : GROUP_BYTES, ksteps,
                                      rows <= 16, acc, panels, panel_bytes, groups,
                                      r0 == 0 ? ahead : -1); /* later rows: weight is here */
                        for (int64_t i = 0; i < rows; ++i)
                            scale_row(acc + i * HALF, sums[r0 + i], a_scale[r0 + i], w_scale + c0,
                                      bias ? (const char *)bias + c0 * bes : NULL, bias_dtype,
                                      (char *)out + ((r0 + i) * out_stride + c0) * oes, cols,
                                      out_dtype);
                    }
                }
            }
            _tile_release();
        }
        free(halves);
    }
    free(sums);
    free(pad);
    return failed ? 2 : 0;
}

#else /* built without AMX-INT8: kiln_int8_gemm_packed never calls the GEMM below */

int kiln_int8_amx_min_rows(void) { return 0; }

int kiln_int8_gemm_amx_panels(const int8_t *a, int64_t a_stride, const float *a_scale,
                              const uint8_t *panels, const float *w_scale, const void *bias,
                              int32_t bias_dtype, void *out, int64_t out_stride, int64_t m,
                              int64_t n, int64_t k, int32_t out_dtype, int32_t num_threads) {
    return 4;
}
#endif
