/* The sampler's draw as a torch op (kiln/sample/inverse_cdf.py's sample_rows): one index a row
 * from softmax(logits * scale) and a uniform, over sample_rows.c's kernel. */
#include <torch/library.h>

#include "torch_ops.h"

namespace {

at::Tensor sample_rows(const at::Tensor &logits, const at::Tensor &scale, const at::Tensor &u) {
    TORCH_CHECK_TYPE(logits.scalar_type() == c10::kFloat && scale.scalar_type() == c10::kFloat &&
                         u.scalar_type() == c10::kDouble,
                     "kiln::sample_rows_native: logits and scale float32, u float64; got ",
                     logits.scalar_type(), ", ", scale.scalar_type(), ", ", u.scalar_type());
    TORCH_CHECK_VALUE(logits.dim() == 2 && scale.dim() == 1 && u.dim() == 1 &&
                          scale.size(0) == logits.size(0) && u.size(0) == logits.size(0),
                      "kiln::sample_rows_native: logits [N, V], scale [N] and u [N]; got ",
                      logits.sizes(), ", ", scale.sizes(), ", ", u.sizes());
    const at::Tensor x = logits.stride(1) == 1 ? logits : logits.contiguous();
    const at::Tensor s = scale.contiguous(), uu = u.contiguous();
    at::Tensor out = at::detail::empty_cpu({x.size(0)}, c10::kLong, false, std::nullopt);
    kiln::check_rc(kiln_sample_rows(x.data_ptr<float>(), x.stride(0), x.size(0), x.size(1),
                                    s.data_ptr<float>(), uu.data_ptr<double>(),
                                    out.data_ptr<int64_t>(), kiln::threads()),
                   "kiln_sample_rows");
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) {
    m.def("sample_rows_native(Tensor logits, Tensor scale, Tensor u) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("sample_rows_native", &sample_rows); }
