"""kiln::rotary_embedding_native(_) bit for bit against the kernel's arithmetic replayed in torch
(rotary_reference.py): float32 and bfloat16, neox and gpt-j, in place and not, strided rows, odd
token counts and head sizes, positions at the cache's edge, NaN / inf / subnormal / tiny inputs.

On an AVX-512 CPU this is the vector path (csrc/rotary_simd.h: by VCVTNE2PS2BF16 where no value
is tiny, the bit trick where one is); test_isa_tiers.py runs the same cases on the builds below.
"""
import pytest
import rotary_reference as ref
import torch

from kiln.native import build

pytestmark = pytest.mark.skipif(not build.available(), reason="no C++ compiler")

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("tokens, hd, nq, nk", [(1, 64, 9, 3), (7, 80, 3, 1), (67, 6, 2, 1),
                                                (5, 192, 1, 2), (3, 130, 2, 2)])
@pytest.mark.parametrize("inputs", ref.INPUTS)
def test_rotary_equals_its_arithmetic_bit_for_bit(dtype, neox, in_place, tokens, hd, nq, nk,
                                                  inputs):
    g = torch.Generator().manual_seed(tokens * 1000 + hd)
    (got_q, got_k), (want_q, want_k) = ref.run_case(g, dtype, neox, in_place, tokens, hd, nq,
                                                    nk, inputs)
    assert ref.same_bits(got_q, want_q)
    assert ref.same_bits(got_k, want_k)


def test_the_replay_is_torchs_rotary_where_no_value_is_nan():
    """The replay rounds as torch's own ops do (kiln.ir's reference): it is a reference, not a
    copy of the kernel."""
    from kiln.ir.layer_ops import _rotary_ref
    g = torch.Generator().manual_seed(3)
    for dtype in DTYPES:
        for neox in (True, False):
            cache = ref.edge_cache(g, 16, 64)
            x = ref.edge_values(g, 5 * 128, dtype, 0.05).view(5, 128)
            x = torch.where(x.isnan(), torch.zeros_like(x), x)
            pos = torch.randint(0, 16, (5,), generator=g)
            want, _ = _rotary_ref(pos, x, x[:, :64], cache, 64, neox)
            got = ref.rotary(pos, x, cache, 64, neox)
            same = (ref.bits(got) == ref.bits(want)) | (got.isnan() & want.isnan())
            assert bool(same.all()), (dtype, neox)
