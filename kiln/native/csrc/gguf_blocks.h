/* GGUF block types as Kiln's CPU kernels see them: ggml's type ids, the file's block sizes, and
 * the layout gguf_layout.c converts a weight's blocks into once, which gguf_matmul.c reads. */
#ifndef KILN_GGUF_BLOCKS_H
#define KILN_GGUF_BLOCKS_H

#include <stdint.h>
#include <string.h>

#if defined(__F16C__)
#include <immintrin.h>

/* The file's fp16 at p, as float32. */
static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
#endif

#define QK 32 /* values per block */
#define K_SUBBLOCKS 8 /* 32-value sub-blocks of a K-quant block */

enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q5_K = 13,
       GGML_Q6_K = 14 }; /* ggml's ids */

/* Bytes of one of the file's blocks of `qtype`; 0 for a type Kiln does not read. */
static inline int gguf_block_bytes(int32_t qtype) {
    switch (qtype) {
        case GGML_Q4_0: return 18; /* fp16 d, 16 bytes of nibbles */
        case GGML_Q4_1: return 20; /* fp16 d, fp16 m, 16 bytes of nibbles */
        case GGML_Q8_0: return 34; /* fp16 d, 32 int8 */
        case GGML_Q4_K: return 144; /* fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 */
        case GGML_Q5_K: return 176; /* as Q4_K, with 32 bytes of fifth bits before the 128 */
        case GGML_Q6_K: return 210; /* 128 low 4 bits, 64 high 2 bits, 16 int8 scales, fp16 d */
        default: return 0;
    }
}

static inline int gguf_block_values(int32_t qtype) {
    return qtype == GGML_Q4_K || qtype == GGML_Q5_K || qtype == GGML_Q6_K ? 256 : QK;
}

/* The kernel's layout, made once at load (gguf_layout.c). Each 32 values first become a block
 * with float32 scales (widening a block's fp16 scales took a quarter of a kernel's time):
 * - Q4_0, Q4_1: [float32 d][float32 m][16 bytes of nibbles] (m = -8 d for Q4_0), 24 bytes;
 * - a Q4_K sub-block: the same, d = d * sc and m = -(dmin * m) (both exact in float32, and
 *   a * q + -b rounds as a * q - b);
 * - a Q5_K sub-block: [d][m][nibbles][4 bytes: bit j value j's fifth bit], 28 bytes;
 * - a Q6_K sub-block: [float32 a0][float32 a1][32 bytes q, the values + 32], a scale (d * scale,
 *   exact) per 16 values, 40 bytes;
 * - Q8_0: [float32 d][32 bytes q + 128], 36 bytes.
 * Then every weight's blocks are interleaved in groups of GROUP_ROWS output rows (gguf_int_dot.h
 * describes a group), so the integer kernel computes a group's 16 outputs in one register. */
#define Q4_KERNEL_BYTES 24
#define Q5_KERNEL_BYTES 28
#define Q6_KERNEL_BYTES 40
#define Q8_KERNEL_BYTES 36
#define GROUP_ROWS 16

/* Q4_0 and Q4_1: each of the file's blocks is one 24-byte kernel block (a Q4_K block is 8). */
static inline int is_q4(int32_t qtype) { return qtype == GGML_Q4_0 || qtype == GGML_Q4_1; }

/* Bytes of one of the file's blocks of `qtype` in the kernel's layout. */
static inline int gguf_kernel_block_bytes(int32_t qtype) {
    if (qtype == GGML_Q4_K) return K_SUBBLOCKS * Q4_KERNEL_BYTES;
    if (qtype == GGML_Q5_K) return K_SUBBLOCKS * Q5_KERNEL_BYTES;
    if (qtype == GGML_Q6_K) return K_SUBBLOCKS * Q6_KERNEL_BYTES;
    if (qtype == GGML_Q8_0) return Q8_KERNEL_BYTES;
    return is_q4(qtype) ? Q4_KERNEL_BYTES : gguf_block_bytes(qtype);
}

#endif
