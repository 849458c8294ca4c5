/* The kernel calls both attention op files make (attention_op.cpp, unified_attention_op.cpp):
 * a step's K/V write and short queries, its long queries' plan and their prefill kernel. */
#ifndef KILN_ATTENTION_RUN_H
#define KILN_ATTENTION_RUN_H

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <cstdint>

#include "attention_args.h"

namespace kiln::attn {

/* k, v [T, nkv*hd] into the cache at the step's slots, then out [T, nh*hd] for the step's
 * requests from q [T, nh*hd] and the cache. Rows may be strided; other rows of out untouched. */
void run_kernel(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                const at::Tensor &out, const KilnKvCache &layer_cache, const KilnAttnStep &step,
                double scale, int64_t window, double softcap, c10::string_view layer);

/* The prefill plan of a step (its long queries' requests, no slots: the K/V are written). */
StepPlan prefill_plan(const at::Tensor &block_table, const at::Tensor &query_start_loc,
                      const at::Tensor &seq_lens, const at::Tensor &reqs, int64_t max_seq_len,
                      int64_t block_size, const char *op);

/* out [T, nh*hd] for the plan's requests (long queries) from q [T, nh*hd] and the cache, which
 * holds the step's K/V already; other rows of out untouched. cache: for_query's. */
void run_prefill(const at::Tensor &q, const at::Tensor &out, const KilnKvCache &cache,
                 const KilnAttnStep &step, double scale, int64_t window, double softcap,
                 int64_t path);

}  // namespace kiln::attn

#endif  // KILN_ATTENTION_RUN_H
