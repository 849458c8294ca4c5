/* Rotary position embedding on CPU: q and k rotated in one pass over the tokens, each product
 * rounded to the model dtype where Hugging Face's torch code rounds (bfloat16 results match it).
 *
 * dtype: 0 float32, 1 bfloat16. Row strides are in elements; columns are contiguous.
 */
#include <stdint.h>

#include "dtype.h"
#include "kernels.h"
#include "rotary_simd.h"

/* Rotation of one [heads, hd] row into out, with cos/sin already in the model dtype:
 * (x1 * cos - x2 * sin, x2 * cos + x1 * sin), each product rounded as torch does; (x1, x2) are
 * each head's halves (neox) or its interleaved pairs x[2i], x[2i + 1] (gpt-j). out may be x
 * (in place): each pair is read before it is written. No FMA contraction (-ffast-math's
 * -ffp-contract=fast): in float32, where round_to is no step, a - b became fma(x1, c, -b), one
 * rounding fewer than torch's, 1 ulp off in a quarter of the values (and finite where torch's
 * product overflows). */
#define KILN_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
static inline __attribute__((always_inline)) KILN_NO_CONTRACT void rotate_row(
    const void *x, int64_t off, void *out, int64_t out_off, int heads, int hd, const float *cs,
    int neox, int dtype) {
    const int half = hd / 2;
    for (int h = 0; h < heads; ++h) {
        const int64_t i0 = off + (int64_t)h * hd, o0 = out_off + (int64_t)h * hd;
        for (int i = 0; i < half; ++i) {
            const int j1 = neox ? i : 2 * i, j2 = neox ? half + i : 2 * i + 1;
            const float x1 = load_elem(x, i0 + j1, dtype), x2 = load_elem(x, i0 + j2, dtype);
            const float c = cs[i], s = cs[half + i];
            const float a = round_to(x1 * c, dtype), b = round_to(x2 * s, dtype);
            const float e = round_to(x2 * c, dtype), f = round_to(x1 * s, dtype);
            store_elem(out, o0 + j1, a - b, dtype);
            store_elem(out, o0 + j2, e + f, dtype);
        }
    }
}

/* q_out [T, nq*hd], k_out [T, nk*hd] = rotary(q, k) at positions [T] (int64), with cos_sin_cache
 * [max_pos, hd] float32 (cos | sin halves), in the neox layout or (is_neox 0) gpt-j's. Row
 * strides in elements; q_out may be q and k_out k (in place, same strides). A position outside
 * the cache fails with 1 (in place, the other rows are rotated all the same), an odd head size
 * with 3. */
KILN_NO_CONTRACT int kiln_rotary(const int64_t *positions, const void *q, int64_t q_stride,
                                 const void *k, int64_t k_stride, void *q_out,
                                 int64_t q_out_stride, void *k_out, int64_t k_out_stride,
                                 const float *cos_sin_cache, int64_t max_pos, int64_t num_tokens,
                                 int32_t nq, int32_t nk, int32_t hd, int32_t is_neox,
                                 int32_t dtype, int32_t num_threads) {
    if (hd % 2) return 3;
    int bad = 0;
#pragma omp parallel for num_threads(num_threads) \
    if (num_tokens >= KILN_ROW_OPS_PARALLEL_MIN_ROWS) reduction(| : bad)
    for (int64_t t = 0; t < num_tokens; ++t) {
        if (positions[t] < 0 || positions[t] >= max_pos) {
            bad = 1;
            continue;
        }
        const float *src = cos_sin_cache + positions[t] * hd;
#if KILN_ROTARY_SIMD
        /* bfloat16 rows take the vector path (rotary_simd.h), each token's cos / sin rounded
         * once into the order it reads them: GCC's vectorized code of the loop below is a few
         * times slower (its scalar rounding bit tricks). float32 keeps the loop, bound by the
         * caches' bandwidth already (an AVX-512 float32 path measured no faster), and so do
         * CPUs without AVX-512. */
        if (dtype == KILN_BF16) {
            float tab[2 * rotary_tab_len(hd)];
            const RotaryPerm perm = rotary_perm(is_neox);
            const int tiny = rotary_bf16_tab(src, hd, is_neox, tab);
            rotary_bf16_row((const uint16_t *)q + t * q_stride,
                            (uint16_t *)q_out + t * q_out_stride, nq, hd, tab, tiny, &perm,
                            is_neox);
            rotary_bf16_row((const uint16_t *)k + t * k_stride,
                            (uint16_t *)k_out + t * k_out_stride, nk, hd, tab, tiny, &perm,
                            is_neox);
            continue;
        }
#endif
        float cs[hd];
        for (int i = 0; i < hd; ++i) cs[i] = round_to(src[i], dtype);
        /* Each (layout, dtype) gets its own inlined loop: with both known the loop vectorizes
         * (a runtime dtype left bfloat16 6x slower than float32). */
#define KILN_ROTATE(NEOX, DTYPE)                                                              \
    do {                                                                                     \
        rotate_row(q, t * q_stride, q_out, t * q_out_stride, nq, hd, cs, NEOX, DTYPE);       \
        rotate_row(k, t * k_stride, k_out, t * k_out_stride, nk, hd, cs, NEOX, DTYPE);       \
    } while (0)
        if (dtype == KILN_F32) {
            if (is_neox) KILN_ROTATE(1, KILN_F32); else KILN_ROTATE(0, KILN_F32);
        } else {
            if (is_neox) KILN_ROTATE(1, KILN_BF16); else KILN_ROTATE(0, KILN_BF16);
        }
#undef KILN_ROTATE
    }
    return bad;
}
