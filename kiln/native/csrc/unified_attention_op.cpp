/* The CPU kernel of `kiln::unified_attention`: within a step it goes from the dispatcher straight
 * to the kernels (attention_run.h), with no Python, for the engine's layers and step handed over.
 *
 * Through Python, a layer cost ~19 us a step besides the kernel (the dispatcher's trip into
 * Python, the forward-context lookup, the checks): ~0.55 ms of a batch-1 step of the 30-layer
 * default model. Python (kiln/attention/cpu_backend.py) plans each step before its first layer
 * and hands the step's metadata tensors (`kiln::attention_begin_step`: a block table and slot
 * mapping per KV cache group) and an engine's layers (an `AttentionLayers` object: name -> KV
 * cache, group, scale, sliding window, soft cap, an fp8 cache's k / v scales) to this file for
 * the step's layers, with its long queries' requests where it has any (a prefill step's Python
 * trip was ~160 us a layer under the profiler, 1 thread): the K/V write and short queries, then
 * the long queries' kernel.
 * Whatever that does not cover (no step handed over, a layer not in the table, another dtype,
 * long queries the prefill kernel has no SIMD tiles for) goes to the Python implementation,
 * registered as `kiln::unified_attention_python`. */
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "attention_args.h"
#include "attention_run.h"
#include "torch_ops.h"

namespace {

using namespace kiln::attn;

struct Layer {
    KilnKvCache cache;
    int64_t group;   /* its KV cache group: which of the step's plans (block table, slots) */
    float scale;
    int64_t window;  /* keys a query sees (a sliding window); 0: all before it */
    double softcap;  /* attention logit soft cap; 0: none */
    /* The cache tensor's storage, held weakly (a table must not keep an engine's KV cache
     * alive), and the data it had: a call finding it freed or moved goes to Python. */
    c10::weak_intrusive_ptr<c10::StorageImpl> storage{
        c10::weak_intrusive_ptr<c10::StorageImpl>(c10::intrusive_ptr<c10::StorageImpl>())};
    const void *data = nullptr;

    bool cache_alive() const {
        return !storage.expired() && storage._unsafe_get_target()->data() == data;
    }
};

/* An engine's layers as the op finds them by name. */
struct AttentionLayers : torch::CustomClassHolder {
    std::unordered_map<std::string, Layer> layers;

    AttentionLayers(std::vector<std::string> names, std::vector<at::Tensor> kv_caches,
                    std::vector<int64_t> groups, std::vector<double> scales,
                    std::vector<int64_t> windows, std::vector<double> softcaps,
                    std::vector<double> k_scales, std::vector<double> v_scales) {
        TORCH_CHECK_VALUE(names.size() == kv_caches.size() && names.size() == groups.size() &&
                              names.size() == scales.size() && names.size() == windows.size() &&
                              names.size() == softcaps.size() &&
                              names.size() == k_scales.size() && names.size() == v_scales.size(),
                          "AttentionLayers: ", names.size(), " names, ", kv_caches.size(),
                          " caches, ", groups.size(), " groups, ", scales.size(), " scales, ",
                          windows.size(), " windows, ", softcaps.size(), " soft caps, ",
                          k_scales.size(), " k_scales and ", v_scales.size(), " v_scales");
        for (size_t i = 0; i < names.size(); ++i) {
            TORCH_CHECK_VALUE(groups[i] >= 0, "AttentionLayers: layer ", names[i], "'s KV cache "
                              "group is ", groups[i]);
            Layer &layer = layers[names[i]];
            layer.cache = scaled_cache(kv_caches[i], k_scales[i], v_scales[i]);
            layer.group = groups[i];
            layer.scale = static_cast<float>(scales[i]);
            layer.window = windows[i];
            layer.softcap = softcaps[i];
            layer.storage = kv_caches[i].storage().getWeakStorageImpl();
            layer.data = kv_caches[i].storage().data();
        }
    }

    int64_t size() const { return static_cast<int64_t>(layers.size()); }
};

/* The step handed over: the engine's layers and the step's plan per KV cache group (each
 * group's block table and slots over the same requests), and where the step has long queries
 * (prefills) their plan per group, for the prefill kernel. None: every call takes the Python
 * path. The forward context it belongs to is process-wide, and so is this. */
struct Step {
    c10::intrusive_ptr<AttentionLayers> table;
    std::vector<std::shared_ptr<const StepPlan>> plans;
    std::vector<std::shared_ptr<const StepPlan>> prefill_plans; /* empty: no long queries */
};

std::mutex mutex; /* guards step */
Step step;
std::atomic<int64_t> calls[2]; /* through the kernel here, through Python */

void begin_step(const c10::intrusive_ptr<AttentionLayers> &table,
                std::vector<at::Tensor> block_tables, const at::Tensor &query_start_loc,
                const at::Tensor &seq_lens, const at::Tensor &reqs,
                std::vector<at::Tensor> slot_mappings, int64_t num_tokens, int64_t max_seq_len,
                int64_t block_size, int64_t num_actual,
                const std::optional<at::Tensor> &prefill_reqs) {
    TORCH_CHECK_VALUE(!block_tables.empty() && block_tables.size() == slot_mappings.size(),
                      "attention_begin_step: ", block_tables.size(), " block tables and ",
                      slot_mappings.size(), " slot mappings (one of each per KV cache group)");
    std::vector<std::shared_ptr<const StepPlan>> plans, prefill_plans;
    for (size_t g = 0; g < block_tables.size(); ++g) {
        if (prefill_reqs.has_value())
            prefill_plans.push_back(std::make_shared<StepPlan>(prefill_plan(
                block_tables[g], query_start_loc, seq_lens, *prefill_reqs, max_seq_len,
                block_size, "attention_begin_step")));
        auto plan = std::make_shared<StepPlan>(block_tables[g], query_start_loc, seq_lens, reqs,
                                               slot_mappings[g], num_tokens, max_seq_len,
                                               block_size);
        plan->num_actual = num_actual;
        plans.push_back(std::move(plan));
    }
    std::lock_guard<std::mutex> lock(mutex);
    step = Step{table, std::move(plans), std::move(prefill_plans)};
}

void end_step() {
    std::lock_guard<std::mutex> lock(mutex);
    step = Step();
}

void python_path(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                 const at::Tensor &out, c10::string_view layer_name) {
    calls[1].fetch_add(1, std::memory_order_relaxed);
    static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(
        "kiln::unified_attention_python", "");
    std::vector<c10::IValue> stack{q, k, v, out,
                                   std::string(layer_name.data(), layer_name.size())};
    op.callBoxed(&stack);
}

void unified_attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                       const at::Tensor &out, c10::string_view layer_name) {
    Step s;
    {
        std::lock_guard<std::mutex> lock(mutex);
        s = step;
    }
    const Layer *layer = nullptr;
    if (s.table) {
        auto it = s.table->layers.find(std::string(layer_name.data(), layer_name.size()));
        if (it != s.table->layers.end() && it->second.cache_alive() &&
            it->second.group < static_cast<int64_t>(s.plans.size()))
            layer = &it->second;
    }
    /* Long queries where the prefill kernel has no SIMD tiles go to SDPA, in Python. */
    const bool prefill = !s.prefill_plans.empty();
    if (!layer || !serves_query(layer->cache, q.scalar_type()) || q.dim() != 2 ||
        (prefill && !kiln_prefill_attention_simd(kiln::dtype_code(q.scalar_type()),
                                                 layer->cache.head_size)))
        return python_path(q, k, v, out, layer_name);
    calls[0].fetch_add(1, std::memory_order_relaxed);
    const StepPlan &plan = *s.plans[layer->group];
    run_kernel(q, k, v, out, layer->cache, plan.args, layer->scale, layer->window,
               layer->softcap, layer_name);
    if (prefill) /* their K/V are in the cache now */
        run_prefill(q, out, for_query(layer->cache, q.scalar_type(), "prefill_attention"),
                    s.prefill_plans[layer->group]->args, layer->scale, layer->window,
                    layer->softcap, KILN_PREFILL_BEST);
    if (plan.num_actual < q.size(0))
        out.narrow(0, plan.num_actual, q.size(0) - plan.num_actual).zero_();
}

std::vector<int64_t> call_counts() { return {calls[0].load(), calls[1].load()}; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) {
    m.class_<AttentionLayers>("AttentionLayers")
        .def(torch::init<std::vector<std::string>, std::vector<at::Tensor>,
                         std::vector<int64_t>, std::vector<double>, std::vector<int64_t>,
                         std::vector<double>, std::vector<double>, std::vector<double>>())
        .def("size", &AttentionLayers::size);
    m.def("attention_begin_step(__torch__.torch.classes.kiln.AttentionLayers layers, "
          "Tensor[] block_tables, Tensor query_start_loc, Tensor seq_lens, Tensor reqs, "
          "Tensor[] slot_mappings, int num_tokens, int max_seq_len, int block_size, "
          "int num_actual, Tensor? prefill_reqs=None) -> ()", &begin_step);
    m.def("attention_end_step() -> ()", &end_step);
    m.def("attention_call_counts() -> int[]", &call_counts);
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) {
    m.impl("unified_attention", &unified_attention);
}
