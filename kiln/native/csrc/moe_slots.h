/* What the MoE expert ops (moe_experts.cpp, moe_experts_int8.cpp) share: the routing's slots
 * (token t's k choices, slot t * k + j) counted and grouped by expert once, and each token's sum
 * of its k experts' outputs by their weights, in float32 in the reference's order (kiln/ir/moe.py's
 * routed_sum: ascending expert, then slot; the product rounded before the add), rounded once. */
#ifndef KILN_MOE_SLOTS_H
#define KILN_MOE_SLOTS_H

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dtype.h"

namespace kiln::moe {

/* How many slots chose each of `experts`, each id checked. */
inline std::vector<int64_t> expert_counts(const int64_t *id, int64_t slots, int64_t experts,
                                          const char *op) {
    std::vector<int64_t> counts(experts, 0);
    for (int64_t s = 0; s < slots; ++s) {
        TORCH_CHECK_INDEX(id[s] >= 0 && id[s] < experts, op, ": topk_ids holds expert ", id[s],
                          ", past the ", experts, " experts");
        ++counts[id[s]];
    }
    return counts;
}

/* slot -> its row among its expert's rows, which start at first_row[expert]; slots keep their
 * ascending order within an expert (the reference's stable sort). */
inline std::vector<int64_t> slot_rows(const int64_t *id, int64_t slots,
                                      std::vector<int64_t> first_row) {
    std::vector<int64_t> row_of(slots);
    for (int64_t s = 0; s < slots; ++s) row_of[s] = first_row[id[s]]++;
    return row_of;
}

/* dst's row row_of[s] = src's row s / k (its token's), for every slot: each expert's rows
 * gathered (row_bytes each). */
inline void gather_rows(const void *src, void *dst, int64_t row_bytes,
                        const std::vector<int64_t> &row_of, int64_t k) {
    const char *from = static_cast<const char *>(src);
    char *to = static_cast<char *>(dst);
    const int64_t slots = static_cast<int64_t>(row_of.size());
    at::parallel_for(0, slots, 64, [&](int64_t s0, int64_t s1) {
        for (int64_t s = s0; s < s1; ++s)
            std::memcpy(to + row_of[s] * row_bytes, from + (s / k) * row_bytes, row_bytes);
    });
}

/* acc[0:h] += y[0:h] * w, the product rounded to float32 before the add as torch's
 * `y.float() * w` then index_add_ does: no FMA contraction (-ffast-math's -ffp-contract=fast
 * would fuse them; a lambda would not inherit the attribute, hence a function of its own). */
__attribute__((optimize("fp-contract=off"))) inline void add_weighted(float *acc, const void *y,
                                                                      float w, int64_t h,
                                                                      int32_t dtype) {
    if (dtype == KILN_F32) {
        const float *v = static_cast<const float *>(y);
        for (int64_t i = 0; i < h; ++i) {
            const float p = v[i] * w;
            acc[i] += p;
        }
    } else {
        const uint16_t *v = static_cast<const uint16_t *>(y);
        for (int64_t i = 0; i < h; ++i) {
            const float p = bf16_to_f32(v[i]) * w;
            acc[i] += p;
        }
    }
}

/* out [tokens, h] (dtype) = per token, the sum over its k slots of weight * ys[row_of[slot]]
 * (ys [rows, h] in dtype), slots in ascending expert order, in float32, rounded once. */
inline void weighted_sum(const int64_t *id, const float *wt, const std::vector<int64_t> &row_of,
                         int64_t tokens, int64_t k, int64_t h, const void *ys, void *out,
                         int32_t dtype) {
    const size_t es = dtype == KILN_F32 ? sizeof(float) : sizeof(uint16_t);
    at::parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
        std::vector<float> acc(h);
        std::vector<int64_t> order(k);
        for (int64_t t = t0; t < t1; ++t) {
            for (int64_t j = 0; j < k; ++j) order[j] = t * k + j;
            std::stable_sort(order.begin(), order.end(),
                             [&](int64_t a, int64_t b) { return id[a] < id[b]; });
            std::fill(acc.begin(), acc.end(), 0.f);
            for (int64_t s : order)
                add_weighted(acc.data(), static_cast<const char *>(ys) + row_of[s] * h * es,
                             wt[s], h, dtype);
            if (dtype == KILN_F32) {
                std::memcpy(static_cast<float *>(out) + t * h, acc.data(), h * sizeof(float));
            } else {
                uint16_t *o = static_cast<uint16_t *>(out) + t * h;
                for (int64_t i = 0; i < h; ++i) o[i] = f32_to_bf16(acc[i]);
            }
        }
    });
}

}  // namespace kiln::moe

#endif
