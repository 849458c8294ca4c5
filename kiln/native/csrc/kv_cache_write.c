/* An attention step's new keys and values into the paged cache (an fp8 cache's rounded, 16 at
 * a time where the CPU has AVX512), before paged_attention.c attends over them. */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16_simd.h"
#include "dtype.h"
#include "fp8_simd.h"
#include "paged_attention.h"

/* x / scale rounded once, as torch's to_cache(x / scale): -ffast-math would take x times a
 * hoisted 1 / scale, an ulp off at times, which moves a value across an fp8 rounding tie. */
static inline float divide(float x, float scale) {
#if KILN_FP8_SIMD
    return _mm_cvtss_f32(_mm_div_round_ss(_mm_set_ss(x), _mm_set_ss(scale),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    volatile float s = scale; /* read each time: no reciprocal to hoist */
    return x / s;
#endif
}

/* n values of src (dtype), divided by scale in float32, as fp8 (kv_dtype) into dst: an fp8
 * cache's write. 16 at a time where the CPU has AVX512 (a scalar loop took 7x a bfloat16
 * cache's copy, measured), the same bytes. A scale of 1 divides by nothing (the same bytes). */
static void quantize_row(uint8_t *dst, const void *src, int64_t n, int dtype, int kv_dtype,
                         float scale) {
    int64_t i = 0;
#if KILN_FP8_SIMD
    const __m512 vscale = _mm512_set1_ps(scale);
    for (; i + 16 <= n; i += 16) {
        __m512i u =
            dtype == KILN_F32
                ? _mm512_loadu_si512((const float *)src + i)
                : _mm512_castps_si512(bf16x16_f32(
                      _mm256_loadu_si256((const __m256i *)((const uint16_t *)src + i))));
        if (scale != 1.f) /* rounded as divide's */
            u = _mm512_castps_si512(_mm512_div_round_ps(
                _mm512_castsi512_ps(u), vscale, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        _mm_storeu_si128((__m128i *)(dst + i), f32x16_fp8(u, kv_dtype));
    }
#endif
    for (; i < n; ++i) {
        const float x = load_elem(src, i, dtype);
        dst[i] = f32_to_fp8(scale != 1.f ? divide(x, scale) : x, kv_dtype);
    }
}

/* Bytes a write must move (K and V) for each thread of a parallel write: below it a parallel
 * region's start-up costs more than the copy it shares (docs/measurements.md, "The KV cache
 * write over the OpenMP threads"), so a decode step's few rows stay on the calling thread. */
#ifndef KV_WRITE_BYTES_PER_THREAD /* -D for a measurement build only */
#define KV_WRITE_BYTES_PER_THREAD (256 << 10)
#endif

int32_t kiln_kv_cache_write_threads(int64_t num_tokens, int64_t row_bytes, int32_t num_threads) {
    const int64_t bytes = 2 * num_tokens * row_bytes;
    int64_t n = bytes / KV_WRITE_BYTES_PER_THREAD;
    if (n > num_threads) n = num_threads;
    return n > 1 ? (int32_t)n : 1;
}

static int64_t parallel_writes; /* writes that ran on more than one thread (tests read it) */

int64_t kiln_kv_cache_parallel_writes(void) {
    int64_t n;
#pragma omp atomic read
    n = parallel_writes;
    return n;
}

/* Row t of k and v (num_kv_heads * head_size values each) into cache slot slots[t]; slot -1
 * writes nowhere (a padding token). All slots are checked before any is written. An fp8 cache
 * takes them divided by its scales, rounded (to nearest even, saturated: f32_to_fp8). A step of
 * many rows splits them over up to num_threads threads (kiln_kv_cache_write_threads): each
 * row's bytes are the same whichever thread writes them, and a prefill's first touches of the
 * cache's pages (page faults, zeroing) are shared too. Slots are distinct but for -1. */
int kiln_kv_cache_write(const void *k, int64_t k_stride, const void *v, int64_t v_stride,
                        const KilnKvCache *c, const KilnAttnStep *st, int32_t num_threads) {
    const size_t elem = elem_size(c->dtype), kv_elem = elem_size(c->kv_dtype);
    const int64_t width = (int64_t)c->num_kv_heads * c->head_size;
    const size_t row_bytes = (size_t)width * kv_elem;
    const int64_t num_tokens = st->num_tokens;
    for (int64_t t = 0; t < num_tokens; ++t)
        if (st->slots[t] < -1 || st->slots[t] >= c->num_slots) return KILN_ATTN_BAD_SLOT;
    const int32_t threads = kiln_kv_cache_write_threads(num_tokens, (int64_t)row_bytes,
                                                        num_threads);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        if (omp_get_num_threads() > 1 && omp_get_thread_num() == 0) {
#pragma omp atomic update
            ++parallel_writes;
        }
        /* static: each thread a contiguous run of tokens, so of pages (a request's slots are) */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_tokens; ++t) {
            const int64_t s = st->slots[t];
            if (s < 0) continue;
            char *kd = (char *)c->key + s * row_bytes, *vd = (char *)c->value + s * row_bytes;
            const char *ks = (const char *)k + t * k_stride * elem;
            const char *vs = (const char *)v + t * v_stride * elem;
            if (c->kv_dtype != c->dtype) {
                quantize_row((uint8_t *)kd, ks, width, c->dtype, c->kv_dtype, c->k_scale);
                quantize_row((uint8_t *)vd, vs, width, c->dtype, c->kv_dtype, c->v_scale);
                continue;
            }
            memcpy(kd, ks, row_bytes);
            memcpy(vd, vs, row_bytes);
        }
    }
    return 0;
}
