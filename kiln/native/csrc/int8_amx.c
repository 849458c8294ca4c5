/* The W8A8 int8 GEMM on AMX-INT8 tiles, with the VNNI kernels' epilogue (int8_simd.h) applied to
 * each 32 x 32 block of int32 sums while it is in L1: out as kiln_int8_gemm writes it, bit for
 * bit (the sums are exact integers either way).
 *
 * The weight stays as stored, int8 [N, K] row-major (one byte a parameter, shared with the VNNI
 * kernel). A tile multiply wants B in VNNI layout (a row per 4 values of k, 16 channels x 4 bytes
 * each), so each thread first repacks its share of the channels: a 16 x 16 transpose of dwords
 * per 1 KiB tile, once per call, a few percent of the multiplies at prefill sizes. Activations
 * are read in place (a padded copy only for a K tail or a short last block of rows). For a
 * decode batch's few rows the roles swap (gemm_few_rows): the weight is read in place as A
 * tiles and the rows are packed, which halves the step's int8 linears at 16-32 rows.
 *
 * Where the tiles are not to be had (kiln_amx_ready, amx.c), the op takes oneDNN's GEMM as before.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "int8_simd.h"
#include "kernels.h"

#if KILN_INT8_SIMD && KILN_AMX_TILES && defined(__AMX_INT8__)

/* A block of output: 2 x 2 tiles of 16 x 16 int32 (tiles 0-3), from 2 A tiles (4, 5) of 16 rows
 * x 64 bytes of k and 2 B tiles (6, 7) of 16 k-quads x 16 channels. */
#define AMX_ROWS 32
#define AMX_COLS 32
#define KSTEP 64
#define TILE_BYTES 1024
/* Up to this many rows the weight is the A operand (gemm_few_rows), read once in place. */
#define FEW_ROWS 128
/* Rows of activations a thread walks its channels over at a time (kept in L2). */
#define ROW_BLOCK 256

int kiln_int8_amx_ready(void) { return kiln_amx_ready(); }

/* Rows [c0, c0 + 32) of an int8 [n, k] matrix (the weight's channels, or a few rows of
 * activations) as B tiles, [k step][2 tiles][16 k-quads][16 rows x 4 bytes]; rows past n and k
 * past its end are zeros. */
static void pack_channels(const int8_t *w, int64_t w_stride, int64_t n, int64_t k, int64_t c0,
                          int64_t ksteps, int8_t *dst) {
    for (int64_t s = 0; s < ksteps; ++s) {
        const int64_t k0 = s * KSTEP;
        const __mmask64 m = k - k0 >= KSTEP ? ~(__mmask64)0 : (((__mmask64)1 << (k - k0)) - 1);
        for (int t = 0; t < 2; ++t) {
            __m512i r[16];
            for (int i = 0; i < 16; ++i) {
                const int64_t c = c0 + 16 * t + i;
                r[i] = c < n ? _mm512_maskz_loadu_epi8(m, w + c * w_stride + k0)
                             : _mm512_setzero_si512();
            }
            kiln_transpose16(r);
            int8_t *tile = dst + (s * 2 + t) * TILE_BYTES;
            for (int i = 0; i < 16; ++i) _mm512_store_si512((__m512i *)(tile + i * 64), r[i]);
        }
    }
}

/* Rows [r0, r0 + rows) of a, zero-padded to 32 rows of ksteps * 64 bytes. */
static void pad_rows(const int8_t *a, int64_t a_stride, int64_t r0, int64_t rows, int64_t k,
                     int64_t kpad, int8_t *dst) {
    memset(dst, 0, (size_t)AMX_ROWS * kpad);
    for (int64_t i = 0; i < rows; ++i) memcpy(dst + i * kpad, a + (r0 + i) * a_stride, (size_t)k);
}

/* acc [32 x 32] = a rows [32, ksteps * 64] (row stride as) x the packed channels. */
static inline void block_product(const int8_t *a, int64_t as, const int8_t *packed,
                                 int64_t ksteps, int32_t *acc) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < ksteps; ++s) {
        _tile_loadd(4, a + s * KSTEP, as);
        _tile_loadd(5, a + 16 * as + s * KSTEP, as);
        _tile_loadd(6, packed + s * 2 * TILE_BYTES, 64);
        _tile_loadd(7, packed + (s * 2 + 1) * TILE_BYTES, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
    }
    _tile_stored(0, acc, AMX_COLS * 4);
    _tile_stored(1, acc + 16, AMX_COLS * 4);
    _tile_stored(2, acc + 16 * AMX_COLS, AMX_COLS * 4);
    _tile_stored(3, acc + 16 * AMX_COLS + 16, AMX_COLS * 4);
}

/* What turns a block of int32 sums into output: the call's scales, bias and output. */
typedef struct {
    const float *a_scale, *w_scale;
    const void *bias;
    void *out;
    int64_t out_stride;
    int32_t bias_dtype, out_dtype;
} Epilogue;

/* out rows [r0, r0 + rows) x channels [c0, c0 + cols) from a block of sums (row stride 32). */
static void epilogue(const Epilogue *e, const int32_t *acc, int64_t r0, int64_t rows,
                     int64_t c0, int64_t cols) {
    const size_t oes = elem_size(e->out_dtype), bes = elem_size(e->bias_dtype);
    for (int64_t i = 0; i < rows; ++i)
        scale_row(acc + i * AMX_COLS, 0, e->a_scale[r0 + i], e->w_scale + c0,
                  e->bias ? (const char *)e->bias + c0 * bes : NULL, e->bias_dtype,
                  (char *)e->out + ((r0 + i) * e->out_stride + c0) * oes, cols, e->out_dtype);
}

/* acc_t [32][32] = acc [32][32] transposed, 16 x 16 blocks at a time. */
static void transpose32(const int32_t *acc, int32_t *acc_t) {
    for (int bi = 0; bi < 2; ++bi)
        for (int bj = 0; bj < 2; ++bj) {
            __m512i r[16];
            for (int i = 0; i < 16; ++i)
                r[i] = _mm512_load_si512(acc + (16 * bi + i) * AMX_COLS + 16 * bj);
            kiln_transpose16(r);
            for (int i = 0; i < 16; ++i)
                _mm512_store_si512(acc_t + (16 * bj + i) * AMX_COLS + 16 * bi, r[i]);
        }
}

/* Few rows (a decode batch): the roles swap, so that the weight is read once, in place, as A
 * tiles of 32 channels, and the rows are what gets packed into B tiles (each thread packs them
 * all: m x k bytes); each 32 x 32 block of sums is transposed back before its epilogue. */
static int gemm_few_rows(const int8_t *a, int64_t a_stride, const int8_t *w, int64_t w_stride,
                         const Epilogue *e, int64_t m, int64_t n, int64_t k,
                         int32_t num_threads) {
    const int64_t ksteps = (k + KSTEP - 1) / KSTEP, kpad = ksteps * KSTEP;
    const int64_t row_panels = (m + AMX_ROWS - 1) / AMX_ROWS;
    const int64_t blocks = (n + AMX_COLS - 1) / AMX_COLS;
    const size_t panel_bytes = (size_t)ksteps * 2 * TILE_BYTES;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        int8_t *packed = (int8_t *)aligned_alloc(64, (size_t)row_panels * panel_bytes);
        int8_t *padded = (int8_t *)aligned_alloc(64, (size_t)AMX_COLS * kpad);
        int32_t acc[AMX_ROWS * AMX_COLS] __attribute__((aligned(64)));
        int32_t acc_t[AMX_ROWS * AMX_COLS] __attribute__((aligned(64)));
        if (!packed || !padded) failed = 1;
        if (!failed) {
            kiln_amx_configure();
            for (int64_t p = 0; p < row_panels; ++p)
                pack_channels(a, a_stride, m, k, p * AMX_ROWS, ksteps, packed + p * panel_bytes);
        }
#pragma omp for schedule(static) /* every thread meets it, failed or not */
        for (int64_t cb = 0; cb < blocks; ++cb) {
            if (failed) continue;
            const int64_t c0 = cb * AMX_COLS, cols = n - c0 < AMX_COLS ? n - c0 : AMX_COLS;
            const int8_t *wa = w + c0 * w_stride;
            int64_t ws = w_stride;
            if (k % KSTEP || cols < AMX_COLS) {
                pad_rows(w, w_stride, c0, cols, k, kpad, padded);
                wa = padded, ws = kpad;
            }
            for (int64_t p = 0; p < row_panels; ++p) {
                const int64_t r0 = p * AMX_ROWS, rows = m - r0 < AMX_ROWS ? m - r0 : AMX_ROWS;
                block_product(wa, ws, packed + p * panel_bytes, ksteps, acc); /* [ch][row] */
                transpose32(acc, acc_t);
                epilogue(e, acc_t, r0, rows, c0, cols);
            }
        }
        if (!failed) _tile_release();
        free(packed);
        free(padded);
    }
    return failed ? 2 : 0;
}

int kiln_int8_gemm_amx(const int8_t *a, int64_t a_stride, const float *a_scale, const int8_t *w,
                       int64_t w_stride, const float *w_scale, const void *bias,
                       int32_t bias_dtype, void *out, int64_t out_stride, int64_t m, int64_t n,
                       int64_t k, int32_t out_dtype, int32_t num_threads) {
    if (!kiln_amx_ready()) return 4;
    if (m == 0 || n == 0) return 0;
    const Epilogue e = {a_scale, w_scale, bias, out, out_stride, bias_dtype, out_dtype};
    if (m <= FEW_ROWS) return gemm_few_rows(a, a_stride, w, w_stride, &e, m, n, k, num_threads);
    const int64_t ksteps = (k + KSTEP - 1) / KSTEP, kpad = ksteps * KSTEP;
    const int64_t panels = (n + AMX_COLS - 1) / AMX_COLS;
    const size_t panel_bytes = (size_t)ksteps * 2 * TILE_BYTES;
    const int direct = k % KSTEP == 0; /* full blocks of rows are read in place */
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        /* this thread's channels: a contiguous share of the panels, packed once */
        const int nt = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t p0 = panels * me / nt, p1 = panels * (me + 1) / nt;
        int8_t *packed =
            p1 > p0 ? (int8_t *)aligned_alloc(64, (size_t)(p1 - p0) * panel_bytes) : NULL;
        int8_t *padded = (int8_t *)aligned_alloc(64, (size_t)AMX_ROWS * kpad);
        int32_t acc[AMX_ROWS * AMX_COLS] __attribute__((aligned(64)));
        if ((p1 > p0 && !packed) || !padded) failed = 1;
        if (!failed && p1 > p0) {
            kiln_amx_configure();
            for (int64_t p = p0; p < p1; ++p)
                pack_channels(w, w_stride, n, k, p * AMX_COLS, ksteps,
                              packed + (p - p0) * panel_bytes);
            for (int64_t b0 = 0; b0 < m; b0 += ROW_BLOCK) {
                const int64_t b1 = b0 + ROW_BLOCK < m ? b0 + ROW_BLOCK : m;
                for (int64_t p = p0; p < p1; ++p) {
                    const int64_t c0 = p * AMX_COLS;
                    const int64_t cols = n - c0 < AMX_COLS ? n - c0 : AMX_COLS;
                    for (int64_t r0 = b0; r0 < b1; r0 += AMX_ROWS) {
                        const int64_t rows = b1 - r0 < AMX_ROWS ? b1 - r0 : AMX_ROWS;
                        const int8_t *rows_at = a + r0 * a_stride;
                        int64_t as = a_stride;
                        if (!direct || rows < AMX_ROWS) {
                            pad_rows(a, a_stride, r0, rows, k, kpad, padded);
                            rows_at = padded;
                            as = kpad;
                        }
                        block_product(rows_at, as, packed + (p - p0) * panel_bytes, ksteps, acc);
                        epilogue(&e, acc, r0, rows, c0, cols);
                    }
                }
            }
            _tile_release();
        }
        free(packed);
        free(padded);
    }
    return failed ? 2 : 0;
}

#else /* built without AMX-INT8: the op never calls the GEMM below */

int kiln_int8_amx_ready(void) { return 0; }

int kiln_int8_gemm_amx(const int8_t *a, int64_t a_stride, const float *a_scale, const int8_t *w,
                       int64_t w_stride, const float *w_scale, const void *bias,
                       int32_t bias_dtype, void *out, int64_t out_stride, int64_t m, int64_t n,
                       int64_t k, int32_t out_dtype, int32_t num_threads) {
    return 4;
}
#endif
