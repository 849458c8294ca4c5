/* The CPU paged-attention kernel's argument structs and entry point, shared by its C source
 * (paged_attention.c) and the C++ ops that call it (attention_op.cpp). */
#ifndef KILN_PAGED_ATTENTION_H
#define KILN_PAGED_ATTENTION_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A layer's caches and one step's metadata, built from their tensors in C++ (attention_op.cpp)
 * and passed by pointer within the library. */
typedef struct {
    void *key, *value;
    int64_t num_slots; /* num_blocks * block_size */
    int32_t num_kv_heads, head_size, block_size;
    /* dtype: the queries' and outputs' (dtype.h; -1 until a call's query says, for an fp8
     * cache); kv_dtype: the cache's elements (the same, or an fp8 code) */
    int32_t dtype, kv_dtype;
    /* an fp8 cache's per-tensor scales (a checkpoint's; 1 else): stored = x / scale when
     * written, x = stored * scale when read (as vLLM's k_scale / v_scale) */
    float k_scale, v_scale;
} KilnKvCache;

typedef struct {
    const int32_t *block_table;
    int64_t bt_stride;
    const int32_t *query_start, *seq_lens, *reqs;
    const int64_t *slots;
    int64_t num_tokens; /* the tokens whose k/v are written */
    int32_t num_sel, max_seq_len;
} KilnAttnStep;

/* Error bits of kiln_paged_attention's result. */
enum {
    KILN_ATTN_BAD_LENGTHS = 1, /* a seq_len above max_seq_len or below its query length */
    KILN_ATTN_NO_MEMORY = 2,
    KILN_ATTN_BAD_SLOT = 4, /* a slot outside the cache: nothing was written */
    KILN_ATTN_BAD_HEADS = 8 /* num_heads not a multiple of num_kv_heads */
};

/* Row t of k and v into cache slot step->slots[t] (kv_cache_write.c), over up to num_threads
 * threads for a step of many rows: 0, or KILN_ATTN_BAD_SLOT with nothing written. */
int kiln_kv_cache_write(const void *k, int64_t k_stride, const void *v, int64_t v_stride,
                        const KilnKvCache *c, const KilnAttnStep *st, int32_t num_threads);
/* The threads a write of num_tokens rows of row_bytes (each of K and V) takes, of num_threads. */
int32_t kiln_kv_cache_write_threads(int64_t num_tokens, int64_t row_bytes, int32_t num_threads);
/* How many writes have run on more than one thread in this process (for tests). */
int64_t kiln_kv_cache_parallel_writes(void);

#ifdef __cplusplus
}
#endif

#endif
