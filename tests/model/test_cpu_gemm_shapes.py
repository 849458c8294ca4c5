"""The packed GEMM asks oneDNN for few distinct row counts: oneDNN and ideep each cache a primitive
per shape (1024, ~0.4 MB each), so a server whose steps carry ever-new token counts grew by
hundreds of MB it never gave back."""
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from kiln.model.layers import cpu_gemm
from kiln.model.layers.linear import ReplicatedLinear

pytestmark = pytest.mark.skipif(
    not cpu_gemm.cpu_packing_available(torch.device("cpu"), torch.float32),
    reason="oneDNN packing needs an x86 CPU build of torch")


def _packed_layer():
    torch.manual_seed(0)
    layer = ReplicatedLinear(64, 128, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    assert cpu_gemm.prepack_for_cpu(layer) == 1
    return layer


# padded rows (2-D and 3-D x), and row counts that need none (the result returned as it is)
@pytest.mark.parametrize("shape", [(33, 64), (100, 64), (257, 64), (3, 41, 64), (1000, 64),
                                   (64, 64), (2, 32, 64)])
def test_rounded_row_counts_give_the_dense_result(shape):
    layer = _packed_layer()
    x = torch.randn(shape)
    out = layer(x)
    assert out.shape == (*shape[:-1], 128) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-4, atol=1e-4)


_GROWTH = textwrap.dedent("""
    import ctypes, sys, torch
    sys.path[:0] = sys.argv[1:]
    from test_cpu_gemm_shapes import _packed_layer
    libc = ctypes.CDLL("libc.so.6")
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
    libc.mallinfo2.restype = Info
    layer = _packed_layer()
    layer(torch.randn(40, 64))
    before = libc.mallinfo2().uordblks
    for rows in range(3, 403):
        layer(torch.randn(rows, 64))
    print((libc.mallinfo2().uordblks - before) >> 20)
""")


def test_ever_new_row_counts_do_not_grow_the_heap():
    # a subprocess: this one's oneDNN caches may be full already (then they only evict)
    here = __file__.rsplit("/", 1)[0]
    out = subprocess.run([sys.executable, "-c", _GROWTH, here, *sys.path], capture_output=True,
                         text=True, timeout=600, check=True).stdout
    # 400 row counts: ~220 MB of cached primitives unrounded, ~30 MB rounded (measured)
    assert int(out.split()[-1]) < 60, out
