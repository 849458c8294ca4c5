/* A weight's GGUF blocks into the layout the matmul kernel reads (gguf_blocks.h), once at load:
 * fp16 scales widened to float32, K-quant blocks cut into 32-value blocks, interleaved in
 * groups of 16 rows. Exact: the kernel's values stay those of gguf's dequantize.
 * Called through kiln/native/gguf_matmul.py. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_blocks.h"
#include "kernels.h"

#if defined(__F16C__)
/* A K-quant block's scales as dequantize computes them, in float32: Q4_K's and Q5_K's 8
 * sub-blocks of 32 get d * sc (a) and dmin * m (b); Q6_K's 16 groups of 16 get d * scale (a). */
typedef struct { float a[16], b[8]; } KScales;

static void k_scales(const uint8_t *blk, int qtype, KScales *s) {
    if (qtype == GGML_Q6_K) {
        const float d = half_at(blk + 208);
        for (int g = 0; g < 16; ++g) s->a[g] = d * (float)(int8_t)blk[192 + g];
        return;
    }
    const float d = half_at(blk), dmin = half_at(blk + 2);
    const uint8_t *q = blk + 4; /* 6-bit scales and mins, packed as llama.cpp's get_scale_min */
    for (int j = 0; j < 8; ++j) {
        const int sc = j < 4 ? q[j] & 63 : (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
        const int m = j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        s->a[j] = d * (float)sc;
        s->b[j] = dmin * (float)m;
    }
}

/* dst = the file's nblocks blocks src as rows of 32-value blocks with float32 scales and
 * unsigned values (gguf_blocks.h). */
static void to_rows(const uint8_t *src, int32_t qtype, int64_t nblocks, uint8_t *dst) {
    const int bb = gguf_block_bytes(qtype);
    if (qtype == GGML_Q4_K || qtype == GGML_Q5_K) {
        const int five = qtype == GGML_Q5_K, out_bytes = five ? Q5_KERNEL_BYTES : Q4_KERNEL_BYTES;
        for (int64_t b = 0; b < nblocks; ++b) {
            /* 128 bytes of nibbles, 2 sub-blocks per 32; Q5_K's 32 bytes of fifth bits first */
            const uint8_t *s = src + b * bb, *q = s + (five ? 48 : 16), *qh = s + 16;
            KScales sc;
            k_scales(s, qtype, &sc);
            for (int u = 0; u < K_SUBBLOCKS; ++u) {
                uint8_t *o = dst + (b * K_SUBBLOCKS + u) * out_bytes;
                const float m = -sc.b[u];
                memcpy(o, &sc.a[u], sizeof(float));
                memcpy(o + 4, &m, sizeof m);
                /* sub-block u: the low (u even) or high nibbles of bytes 32 (u / 2) .. + 31;
                 * as Q4_1 holds them: value j in byte j's low nibble, j + 16 in its high */
                const uint8_t *p = q + (u >> 1) * 32;
                const int shift = (u & 1) * 4;
                for (int j = 0; j < 16; ++j)
                    o[8 + j] = (uint8_t)(((p[j] >> shift) & 15) |
                                         (((p[j + 16] >> shift) & 15) << 4));
                if (five) { /* value t's fifth bit: bit u of qh[t] */
                    uint32_t bits = 0;
                    for (int t = 0; t < 32; ++t) bits |= (uint32_t)((qh[t] >> u) & 1) << t;
                    memcpy(o + 24, &bits, sizeof bits);
                }
            }
        }
        return;
    }
    if (qtype == GGML_Q6_K) {
        for (int64_t b = 0; b < nblocks; ++b) {
            const uint8_t *s = src + b * bb;
            KScales sc;
            k_scales(s, qtype, &sc);
            for (int u = 0; u < K_SUBBLOCKS; ++u) {
                uint8_t *o = dst + (b * K_SUBBLOCKS + u) * Q6_KERNEL_BYTES;
                memcpy(o, &sc.a[2 * u], 2 * sizeof(float)); /* groups 2u and 2u + 1 */
                /* value 32u + t: 4 low bits from ql[64 (u / 4) + 32 (u % 2) + t] (high nibble
                 * when u / 2 is odd), 2 high bits from qh[32 (u / 4) + t] >> 2 (u % 4) */
                const uint8_t *ql = s + (u >> 2) * 64 + (u & 1) * 32, *qh = s + 128 + (u >> 2) * 32;
                const int lshift = ((u >> 1) & 1) * 4, hshift = 2 * (u & 3);
                for (int t = 0; t < 32; ++t) /* q, the value + 32 */
                    o[8 + t] = (uint8_t)(((ql[t] >> lshift) & 15) | (((qh[t] >> hshift) & 3) << 4));
            }
        }
        return;
    }
    if (qtype == GGML_Q8_0) {
        for (int64_t b = 0; b < nblocks; ++b) {
            const uint8_t *s = src + b * bb;
            uint8_t *o = dst + b * Q8_KERNEL_BYTES;
            const float d = half_at(s);
            memcpy(o, &d, sizeof d);
            for (int t = 0; t < QK; ++t) o[4 + t] = (uint8_t)((int8_t)s[2 + t] + 128);
        }
        return;
    }
    const int nibbles = qtype == GGML_Q4_1 ? 4 : 2; /* after d (and m) */
    for (int64_t b = 0; b < nblocks; ++b) {
        const uint8_t *s = src + b * bb;
        uint8_t *o = dst + b * Q4_KERNEL_BYTES;
        const float d = half_at(s);
        const float m = qtype == GGML_Q4_1 ? half_at(s + 2) : -8.f * d; /* exact */
        memcpy(o, &d, sizeof d);
        memcpy(o + 4, &m, sizeof m);
        memcpy(o + 8, s + nibbles, 16);
    }
}

/* GROUP_ROWS rows of nb 32-value blocks of to_rows (bb bytes each) into one group as
 * gguf_int_dot.h reads it: per block, the 16 rows' first scales (and their second ones), then
 * their values, row c's bytes 4 j .. 4 j + 3 at 64 j + 4 c of the values (4-bit ones two
 * values a byte), then for 5-bit blocks 8 masks (bit 4 c + i of mask j: the fifth bit of row
 * c's value 4 j + i). */
static void interleave(const uint8_t *rows, int64_t nb, int bb, uint8_t *dst) {
    const int five = bb == Q5_KERNEL_BYTES, scales = bb == Q8_KERNEL_BYTES ? 1 : 2;
    const int value_bytes = bb == Q4_KERNEL_BYTES || five ? 16 : QK;
    for (int64_t b = 0; b < nb; ++b) {
        uint8_t *o = dst + b * GROUP_ROWS * bb, *values = o + 64 * scales;
        uint64_t masks[8] = {0};
        for (int c = 0; c < GROUP_ROWS; ++c) {
            const uint8_t *blk = rows + (c * nb + b) * bb, *v = blk + 4 * scales;
            for (int sc = 0; sc < scales; ++sc) memcpy(o + 64 * sc + 4 * c, blk + 4 * sc, 4);
            for (int j = 0; j < value_bytes; ++j) values[(j / 4) * 64 + 4 * c + j % 4] = v[j];
            if (five) {
                uint32_t bits;
                memcpy(&bits, v + 16, sizeof bits);
                for (int t = 0; t < QK; ++t)
                    masks[t / 4] |= (uint64_t)((bits >> t) & 1) << (4 * c + t % 4);
            }
        }
        if (five) memcpy(values + 256, masks, sizeof masks);
    }
}

/* dst (padded rows * row_blocks * gguf_kernel_block_bytes, rows rounded up to whole groups of
 * GROUP_ROWS) = the file's blocks src ([rows, row_blocks]) in the kernel's layout. The last
 * group's missing rows are zeros: every scale 0, so their outputs are 0 and go unwritten.
 * 1 for a type it does not read (or without F16C, which the kernel needs too); 3 when out of
 * memory. */
int kiln_gguf_to_kernel_layout(const uint8_t *src, int32_t qtype, int64_t rows,
                               int64_t row_blocks, uint8_t *dst) {
    if (gguf_block_bytes(qtype) == 0 || rows < 0 || row_blocks < 0) return 1;
    /* 32-value blocks a row, and bytes of each */
    const int64_t nb = row_blocks * (gguf_block_values(qtype) / QK);
    const int bb = gguf_kernel_block_bytes(qtype) / (gguf_block_values(qtype) / QK);
    uint8_t *group = (uint8_t *)malloc((size_t)(GROUP_ROWS * nb * bb));
    if (!group) return 3;
    const int64_t row_bytes = row_blocks * gguf_block_bytes(qtype);
    for (int64_t g = 0; g * GROUP_ROWS < rows; ++g) {
        const int64_t left = rows - g * GROUP_ROWS, have = left < GROUP_ROWS ? left : GROUP_ROWS;
        if (have < GROUP_ROWS) memset(group, 0, (size_t)(GROUP_ROWS * nb * bb));
        to_rows(src + g * GROUP_ROWS * row_bytes, qtype, have * row_blocks, group);
        interleave(group, nb, bb, dst + g * GROUP_ROWS * nb * bb);
    }
    free(group);
    return 0;
}

#else
int kiln_gguf_to_kernel_layout(const uint8_t *src, int32_t qtype, int64_t rows,
                               int64_t row_blocks, uint8_t *dst) {
    (void)src, (void)qtype, (void)rows, (void)row_blocks, (void)dst;
    return 1;
}
#endif
