"""A linear layer's IR call (cpu_gemm.linear_call: gguf_linear where it holds blocks, else linear)
run by its op's native implementation, the C++ kernel that picks a path per call."""
from kiln.model.layers import cpu_gemm


def run_native(layer, x, bias=None):
    op, args = cpu_gemm.linear_call(layer, bias)
    return op.impls["native"].fn(x, *args)
