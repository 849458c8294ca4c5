/* The CPU kernel of `kiln::unified_attention`: within a decode step, a layer's call goes from the
 * dispatcher straight to the paged-attention kernel (csrc/paged_attention.c), with no Python.
 *
 * Through Python, a layer cost ~19 us a step besides the kernel (the dispatcher's trip into
 * Python, the forward-context lookup, the checks, ctypes): ~0.55 ms of a batch-1 step of the
 * 30-layer default model. Python (kiln/attention/cpu_backend.py) plans each step (StepArgs)
 * before its first layer (the model runner asks it to; called without that, at its first
 * layer), then hands the plan and a table of the engine's layers (name -> caches, scale) to
 * this file for the step's layers. Whatever the plan does not cover (no step handed over, a
 * layer not in the table, another dtype) goes to the Python implementation, registered as
 * `kiln::unified_attention_python`. */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "aten_dtype.h"
#include "paged_attention.h"

namespace {

struct Layer {
    const KilnKvCache *cache; /* a paged_attention.CacheArgs struct, kept alive by Python */
    float scale;
    /* The cache tensor's storage, held weakly (a table must not keep an engine's KV cache
     * alive), and the data it had: a call finding it freed or moved goes to Python. */
    c10::weak_intrusive_ptr<c10::StorageImpl> storage{
        c10::weak_intrusive_ptr<c10::StorageImpl>(c10::intrusive_ptr<c10::StorageImpl>())};
    const void *data = nullptr;

    bool cache_alive() const {
        return !storage.expired() && storage._unsafe_get_target()->data() == data;
    }
};
using Table = std::unordered_map<std::string, Layer>;

/* The step handed over: the engine's table, its plan, and how many of its tokens are real
 * (the rest are padding rows, zeroed). No table: every call takes the Python path. The forward
 * context it belongs to is process-wide, and so is this. */
struct Step {
    std::shared_ptr<const Table> table;
    const KilnAttnStep *args = nullptr;
    int64_t num_actual = 0;
};

std::mutex mutex; /* guards tables, next_table and step */
std::unordered_map<int64_t, std::shared_ptr<const Table>> tables;
int64_t next_table = 1;
Step step;
std::atomic<KilnPagedAttentionFn> kernel_fn{nullptr};
std::atomic<int64_t> calls[2]; /* through the kernel here, through Python */

void python_path(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                 const at::Tensor &out, c10::string_view layer_name) {
    calls[1].fetch_add(1, std::memory_order_relaxed);
    static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(
        "kiln::unified_attention_python", "");
    std::vector<c10::IValue> stack{q, k, v, out,
                                   std::string(layer_name.data(), layer_name.size())};
    op.callBoxed(&stack);
}

void check_rows(const char *name, const at::Tensor &t, at::ScalarType dtype, int64_t width,
                int64_t num_tokens) {
    TORCH_CHECK_VALUE(t.scalar_type() == dtype && t.dim() == 2 && t.size(1) == width &&
                          t.stride(1) == 1 && t.size(0) >= num_tokens,
                      "kiln::unified_attention: ", name, " must be ", dtype, " [>= ", num_tokens,
                      ", ", width, "] with contiguous rows, got ", t.scalar_type(), " ",
                      t.sizes(), " strides ", t.strides());
}

void unified_attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                       const at::Tensor &out, c10::string_view layer_name) {
    Step s;
    {
        std::lock_guard<std::mutex> lock(mutex);
        s = step;
    }
    const KilnPagedAttentionFn kernel = kernel_fn.load(std::memory_order_relaxed);
    const Layer *layer = nullptr;
    if (s.table && kernel) {
        auto it = s.table->find(std::string(layer_name.data(), layer_name.size()));
        if (it != s.table->end() && it->second.cache_alive()) layer = &it->second;
    }
    if (!layer || kiln_dtype_code(q.scalar_type()) != layer->cache->dtype || q.dim() != 2)
        return python_path(q, k, v, out, layer_name);
    calls[0].fetch_add(1, std::memory_order_relaxed);
    const KilnKvCache &cache = *layer->cache;
    const int64_t width = q.size(1), kv_width = int64_t{cache.num_kv_heads} * cache.head_size;
    const int64_t num_tokens = s.args->num_tokens;
    check_rows("q", q, q.scalar_type(), width, num_tokens);
    check_rows("k", k, q.scalar_type(), kv_width, num_tokens);
    check_rows("v", v, q.scalar_type(), kv_width, num_tokens);
    check_rows("out", out, q.scalar_type(), width, num_tokens);
    TORCH_CHECK_VALUE(width % cache.head_size == 0, "kiln::unified_attention: q's width ", width,
                      " is not whole heads of ", cache.head_size, " values");
    const int rc = kernel(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
                          v.stride(0), out.data_ptr(), out.stride(0),
                          static_cast<int32_t>(width / cache.head_size), layer->scale, &cache,
                          s.args, at::get_num_threads());
    TORCH_CHECK_INDEX(!(rc & KILN_ATTN_BAD_SLOT), "kiln::unified_attention (", layer_name,
                      "): a slot is outside [-1, ", cache.num_slots,
                      ") (the cache's blocks x block_size); nothing was written");
    TORCH_CHECK(rc == 0, "kiln::unified_attention (", layer_name, "): the CPU kernel failed with ",
                "code ", rc, ":", (rc & KILN_ATTN_BAD_LENGTHS) ? " a seq_len above max_seq_len or "
                "below its query length" : "", (rc & KILN_ATTN_NO_MEMORY) ? " out of memory" : "",
                (rc & KILN_ATTN_BAD_HEADS) ? " num_heads not a multiple of num_kv_heads" : "");
    if (s.num_actual < q.size(0)) out.narrow(0, s.num_actual, q.size(0) - s.num_actual).zero_();
}

/* A table of layers: names[i] attends with the CacheArgs struct at caches[i], made from
 * kv_caches[i], and scales[i]. */
int64_t bind(const std::vector<std::string> &names, const std::vector<at::Tensor> &kv_caches,
             const std::vector<int64_t> &caches, const std::vector<double> &scales) {
    TORCH_CHECK_VALUE(names.size() == kv_caches.size() && names.size() == caches.size() &&
                          names.size() == scales.size(),
                      "_cpu_attention_bind: ", names.size(), " names, ", kv_caches.size(),
                      " caches, ", caches.size(), " cache structs and ", scales.size(), " scales");
    auto table = std::make_shared<Table>();
    for (size_t i = 0; i < names.size(); ++i) {
        Layer &layer = (*table)[names[i]];
        layer.cache = reinterpret_cast<const KilnKvCache *>(caches[i]);
        layer.scale = static_cast<float>(scales[i]);
        layer.storage = kv_caches[i].storage().getWeakStorageImpl();
        layer.data = kv_caches[i].storage().data();
    }
    std::lock_guard<std::mutex> lock(mutex);
    tables[next_table] = std::move(table);
    return next_table++;
}

void unbind(int64_t id) {
    std::lock_guard<std::mutex> lock(mutex);
    tables.erase(id); /* a step still using it holds it until it ends */
}

/* Hand over a step (table id, KilnAttnStep address, real tokens); table 0 ends it. */
void set_step(int64_t table, int64_t args, int64_t num_actual) {
    std::lock_guard<std::mutex> lock(mutex);
    if (table == 0) {
        step = Step();
        return;
    }
    auto it = tables.find(table);
    TORCH_CHECK_VALUE(it != tables.end(), "_cpu_attention_set_step: no table ", table);
    step = Step{it->second, reinterpret_cast<const KilnAttnStep *>(args), num_actual};
}

void set_kernel(int64_t fn) { kernel_fn.store(reinterpret_cast<KilnPagedAttentionFn>(fn)); }

std::vector<int64_t> call_counts() { return {calls[0].load(), calls[1].load()}; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) {
    m.def("_cpu_attention_bind(str[] names, Tensor[] kv_caches, int[] caches, float[] scales) "
          "-> int", &bind);
    m.def("_cpu_attention_unbind(int table) -> ()", &unbind);
    m.def("_cpu_attention_set_step(int table, int args, int num_actual) -> ()", &set_step);
    m.def("_cpu_attention_set_kernel(int fn) -> ()", &set_kernel);
    m.def("_cpu_attention_call_counts() -> int[]", &call_counts);
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("unified_attention", &unified_attention); }
