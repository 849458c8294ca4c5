/* Every C kernel's entry point, for the C++ torch ops that call them (ops_*.cpp, linear_op.cpp,
 * attention_op.cpp): one library, so each is a plain call. Each source includes this too, so a
 * definition that drifts from its declaration fails to compile (C linkage: no overloading).
 * 0 on success; the codes are each kernel's (its source says). dtype: dtype.h's codes. */
#ifndef KILN_KERNELS_H
#define KILN_KERNELS_H

#include <stdint.h>

#include "paged_attention.h"

/* The row-wise layer ops (layer_ops.c, layer_norm.c, rotary.c) keep fewer rows on one thread: a
 * decode batch's few microseconds of work there are of the order of waking the OpenMP team. */
#define KILN_ROW_OPS_PARALLEL_MIN_ROWS 64

#ifdef __cplusplus
extern "C" {
#endif

/* layer_ops.c */
int kiln_rms_norm(const void *x, int64_t x_stride, const void *residual, int64_t res_stride,
                  void *residual_out, const void *weight, void *out, int64_t out_stride,
                  int64_t rows, int32_t hidden, float eps, int32_t dtype, int32_t num_threads)
    __attribute__((noipa));
int kiln_silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t rows, int32_t d,
                      int32_t dtype, int32_t num_threads) __attribute__((noipa));

/* rotary.c */
int kiln_rotary(const int64_t *positions, const void *q, int64_t q_stride, const void *k,
                int64_t k_stride, void *q_out, int64_t q_out_stride, void *k_out,
                int64_t k_out_stride, const float *cos_sin_cache,
                int64_t max_pos, int64_t num_tokens, int32_t nq, int32_t nk, int32_t hd,
                int32_t is_neox, int32_t dtype, int32_t num_threads);

/* layer_norm.c */
int kiln_layer_norm(const void *x, int64_t x_stride, const void *residual, int64_t res_stride,
                    void *residual_out, const void *weight, const void *bias, void *out,
                    int64_t out_stride, int64_t rows, int32_t hidden, float eps, int32_t dtype,
                    int32_t num_threads);
int kiln_gelu_tanh(const void *x, int64_t x_stride, void *out, int64_t rows, int32_t d,
                   int32_t dtype, int32_t num_threads);

/* gemv.c */
int kiln_gemv(const void *x, const void *weight, const void *bias, void *out, int32_t m,
              int64_t n, int64_t k, int32_t dtype, int32_t num_threads);

/* int4_linear.c (W4A16 over the canonical int4 layout; scale codes 0 f32, 1 bf16, 2 f16) */
#define KILN_INT4_GEMV_MAX_ROWS 8
int kiln_int4_simd(void);
int64_t kiln_int4_gemv_row_limit(int32_t dtype);
int kiln_int4_gemv(const void *x, const uint8_t *w, const void *scales, int32_t s_code,
                   const uint8_t *zeros, const void *bias, void *out, int32_t m, int64_t n,
                   int64_t k, int64_t group, int32_t dtype, int32_t num_threads);
int kiln_int4_dequant(const uint8_t *w, const void *scales, int32_t s_code, const uint8_t *zeros,
                      int64_t row0, int64_t rows, int64_t k, int64_t group, void *out,
                      int32_t dtype, int32_t num_threads);

/* gguf_matmul.c, gguf_layout.c */
int kiln_gguf_simd(void);
int kiln_gguf_block_bytes(int32_t qtype);
int kiln_gguf_block_values(int32_t qtype);
int kiln_gguf_kernel_block_bytes(int32_t qtype);
int kiln_gguf_group_rows(void);
int kiln_gguf_matmul(const void *x, const uint8_t *weight, int32_t qtype, const void *bias,
                     void *out, int32_t m, int64_t n, int64_t k, int32_t dtype,
                     int32_t f32_limbs, int32_t num_threads);
int kiln_gguf_to_kernel_layout(const uint8_t *src, int32_t qtype, int64_t rows,
                               int64_t row_blocks, uint8_t *dst);

/* gguf_rows.c */
int kiln_gguf_rows(const uint8_t *blocks, int32_t qtype, int64_t in_features,
                   const int64_t *ids, int64_t n, void *out, int32_t dtype, int32_t num_threads);

/* int8_ops.c */
int kiln_int8_isa(void);
int kiln_dynamic_int8_quant(const void *x, int64_t x_stride, int8_t *q, float *scale,
                            int64_t rows, int64_t k, int32_t dtype, int32_t num_threads);
int kiln_rms_norm_int8_quant(const void *x, int64_t x_stride, const void *residual,
                             int64_t res_stride, void *residual_out, const void *weight, int8_t *q,
                             float *scale, int64_t rows, int32_t hidden, float eps, int32_t dtype,
                             int32_t num_threads);
int kiln_silu_and_mul_int8_quant(const void *x, int64_t x_stride, int8_t *q, float *scale,
                                 int64_t rows, int32_t d, int32_t dtype, int32_t num_threads);
int kiln_int8_scale(const int32_t *acc, int64_t acc_stride, const float *a_scale,
                    const float *w_scale, const void *bias, int32_t bias_dtype, void *out,
                    int64_t out_stride, int64_t m, int64_t n, int32_t out_dtype,
                    int32_t num_threads);
int kiln_int8_gemm(const int8_t *a, int64_t a_stride, const float *a_scale, const int8_t *w,
                   int64_t w_stride, const float *w_scale, const void *bias, int32_t bias_dtype,
                   void *out, int64_t out_stride, int64_t m, int64_t n, int64_t k,
                   int32_t out_dtype, int32_t num_threads);

/* amx.c */
int kiln_amx_ready(void);

/* bf16_amx_gemm.c: out [m, n] (row stride ldo) = x [m, k] @ w [n, k]^T, bfloat16, on AMX-BF16
 * tiles over the weight as stored; _ready 0 where built without them or the OS refuses them */
int kiln_bf16_amx_gemm_ready(void);
int kiln_bf16_amx_gemm(const void *x, const void *w, void *out, int64_t ldo, int64_t m, int64_t n,
                       int64_t k, int32_t num_threads);

/* rows_gemm.c: out [m, n] (row stride ldo) = x [m, k] @ w [n, k]^T, float32 or bfloat16, several
 * rows of x against the weight as stored, for CPUs without AMX tiles; _isa: how this build runs
 * the dtype (KILN_ROWS_NONE where built without AVX-512: the call returns 1) */
enum { KILN_ROWS_NONE = 0, KILN_ROWS_AVX512F = 1, KILN_ROWS_BF16_DOT = 2 };
int kiln_rows_gemm_isa(int32_t dtype);
int kiln_rows_gemm(const void *x, const void *w, void *out, int64_t ldo, int64_t m, int64_t n,
                   int64_t k, int32_t dtype, int32_t num_threads);

/* int8_vnni_gemm.c: kiln_int8_gemm over the weight in 64-column panels (k a multiple of 4),
 * packed at load (_packed) or for this call (_panels, for many rows); from
 * kiln_int8_amx_min_rows() rows on AMX tiles (int8_amx_panels.c) */
int kiln_int8_gemm_packed(const int8_t *a, int64_t a_stride, const float *a_scale,
                          const uint8_t *panels, const float *w_scale, const void *bias,
                          int32_t bias_dtype, void *out, int64_t out_stride, int64_t m, int64_t n,
                          int64_t k, int32_t out_dtype, int32_t num_threads);
int kiln_int8_gemm_panels(const int8_t *a, int64_t a_stride, const float *a_scale,
                          const int8_t *w, int64_t w_stride, const float *w_scale,
                          const void *bias, int32_t bias_dtype, void *out, int64_t out_stride,
                          int64_t m, int64_t n, int64_t k, int32_t out_dtype,
                          int32_t num_threads);

/* int8_amx_panels.c: kiln_int8_gemm_packed on AMX-INT8 tiles, 4 where they are not granted;
 * the rows from which _packed takes them, 0 where it never does (built without AMX-INT8, or the
 * OS refuses this process the tiles' state) */
int kiln_int8_amx_min_rows(void);
int kiln_int8_gemm_amx_panels(const int8_t *a, int64_t a_stride, const float *a_scale,
                              const uint8_t *panels, const float *w_scale, const void *bias,
                              int32_t bias_dtype, void *out, int64_t out_stride, int64_t m,
                              int64_t n, int64_t k, int32_t out_dtype, int32_t num_threads);

/* int8_gemm_silu_quant.c: dynamic_int8_quant(silu_and_mul(kiln_int8_gemm_packed)) into q [m, n / 2]
 * and scale [m]; the rows from which threads take blocks of rows through all three, 0 where
 * they never do */
int kiln_int8_gemm_silu_quant_min_rows(void);
int kiln_int8_gemm_silu_quant(const int8_t *a, int64_t a_stride, const float *a_scale,
                              const uint8_t *panels, const float *w_scale, const void *bias,
                              int32_t bias_dtype, int8_t *q, float *scale, int64_t m, int64_t n,
                              int64_t k, int32_t dtype, int32_t num_threads);

/* paged_attention.c */
int kiln_paged_attention(const void *q, int64_t q_stride, const void *k, int64_t k_stride,
                         const void *v, int64_t v_stride, void *out, int64_t out_stride,
                         int32_t num_heads, float scale, int32_t window, float softcap,
                         const KilnKvCache *cache, const KilnAttnStep *step,
                         int32_t num_threads);
/* 1 where a decode's query . key products of this dtype and head size run on AVX512-BF16 */
int kiln_paged_attention_bf16_dot(int32_t dtype, int32_t head_size);

/* prefill_attention.c */
int kiln_prefill_attention_simd(int32_t dtype, int32_t head_size);
int kiln_prefill_attention_amx(int32_t dtype, int32_t head_size);
enum { KILN_PREFILL_BEST = 0, KILN_PREFILL_AVX512 = 1, KILN_PREFILL_PORTABLE = 2 };
int kiln_prefill_attention(const void *q, int64_t q_stride, void *out, int64_t out_stride,
                           int64_t num_rows, int32_t num_heads, float scale, int32_t window,
                           float softcap, const KilnKvCache *cache, const KilnAttnStep *step,
                           int32_t path, int32_t num_threads);

/* sample_rows.c */
int kiln_sample_rows(const float *logits, int64_t x_stride, int64_t rows, int64_t vocab,
                     const float *scale, const double *u, int64_t *out, int32_t num_threads);

#ifdef __cplusplus
}
#endif

#endif
