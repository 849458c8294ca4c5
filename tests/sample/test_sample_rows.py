"""sample_rows: the draw of inverse_cdf over softmax(logits * scale), fused on CPU into one
kernel (csrc/sample_rows.c) that never builds the probability table: the same index on the
same uniform, masked (-inf) tokens never drawn, blocks and their boundaries as inverse_cdf's
(the draws' distribution: test_inverse_cdf.py)."""
import math

import pytest
import torch

from kiln.native import build
from kiln.sample import inverse_cdf as inverse_cdf_module
from kiln.sample.inverse_cdf import BLOCK, inverse_cdf, kernel_draws, sample_rows
from kiln.sample.sampler import Sampler
from kiln.sample.sampling_metadata import build_sampling_metadata
from kiln.sampling_params import SamplingParams

NEG = float("-inf")


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert build.available()


def kernel(logits, scale, u) -> torch.Tensor:
    return torch.ops.kiln.sample_rows_native(logits, scale, u)


def draw(logits: list[float] | torch.Tensor, u: float) -> int:
    x = torch.as_tensor(logits, dtype=torch.float32).reshape(1, -1)
    return int(kernel(x, torch.ones(1), torch.tensor([u], dtype=torch.float64))[0])


def test_the_choice_of_the_kernel():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert kernel_draws(cpu, torch.float32, True)
    assert not kernel_draws(cpu, torch.float32, False)
    assert not kernel_draws(cpu, torch.bfloat16, True)
    assert not kernel_draws(cuda, torch.float32, True)


@pytest.mark.parametrize("vocab", [1, 7, 255, 256, 257, 5000, 49152])
def test_the_kernel_draws_what_inverse_cdf_of_the_softmax_draws(vocab, monkeypatch):
    """Each index is the entry whose interval of the float64 cdf holds u (within rounding of the
    softmax's division, which the kernel leaves out), never a masked one, and on these rows the
    very index inverse_cdf picks."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(64, vocab, generator=g) * 4
    if vocab > 3:
        x[:, ::3] = NEG
    scale = torch.rand(64, generator=g) * 2 + 0.2  # 1 / temperature
    u = torch.rand(64, dtype=torch.float64, generator=g)
    u[:2] = torch.tensor([0.0, math.nextafter(1.0, 0.0)])
    got = kernel(x, scale, u)
    probs = (x * scale[:, None]).softmax(dim=1)
    assert torch.equal(got, inverse_cdf(probs, u))
    assert torch.equal(got, sample_rows(x, scale, u))  # CPU float32: the kernel
    assert torch.equal(sample_rows(x * scale[:, None], None, u), kernel(x * scale[:, None],
                                                                          torch.ones(64), u))
    with monkeypatch.context() as m:  # elsewhere (CUDA, other dtypes): torch's softmax
        m.setattr(inverse_cdf_module, "kernel_draws", lambda *args: False)
        assert torch.equal(sample_rows(x, scale, u), got)
        assert torch.equal(sample_rows(x * scale[:, None], None, u), inverse_cdf(probs, u))
    cdf = probs.double().cumsum(dim=1)
    p, hi = probs.double().gather(1, got[:, None])[:, 0], cdf.gather(1, got[:, None])[:, 0]
    target = u * cdf[:, -1]
    assert (p > 0).all()
    assert ((hi - p - 1e-6 <= target) & (target <= hi + 1e-6)).all()


def test_blocks_and_their_boundaries():
    vocab = 3 * BLOCK + 17  # the last block partial
    x = torch.full((vocab,), NEG)
    x[[BLOCK - 1, BLOCK, 2 * BLOCK + 5, vocab - 1]] = 0.0  # four equal masses: exact quarters
    picks = [draw(x, u) for u in (0.0, 0.2499, 0.25, 0.4999, 0.5, 0.74, 0.75, 0.9999)]
    assert picks == [BLOCK - 1, BLOCK - 1, BLOCK, BLOCK, 2 * BLOCK + 5, 2 * BLOCK + 5,
                     vocab - 1, vocab - 1]


def test_masked_entries_are_never_drawn_even_at_the_ends():
    x = torch.full((2 * BLOCK,), NEG)
    x[BLOCK + 3], x[BLOCK + 9] = 1.0, 0.0
    for u in (0.0, 1e-300, 0.7, math.nextafter(1.0, 0.0), 1.0):
        assert draw(x, u) in (BLOCK + 3, BLOCK + 9)
    assert draw([0.0] * 300 + [NEG] * 10, 1.0) == 299
    assert draw([NEG] * 5, 0.5) == 0  # nothing to draw: index 0, as inverse_cdf gives


def test_bad_arguments_are_named():
    x = torch.zeros(2, 8)
    with pytest.raises(TypeError, match="logits and scale float32, u float64"):
        kernel(x.double(), torch.ones(2), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"logits \[N, V\], scale \[N\] and u \[N\]"):
        kernel(x, torch.ones(3), torch.zeros(2, dtype=torch.float64))


def test_the_sampler_draws_at_temperature_with_and_without_filters():
    """A random row's token under temperature alone (the kernel takes 1 / T) and under top-k
    (the filtered logits at scale 1) is inverse_cdf's over Sampler.probs on the same uniform."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 3000, generator=g) * 3
    for extra in ({}, {"top_k": 50}):
        params = [SamplingParams(temperature=t, seed=7 + i, **extra)
                  for i, t in enumerate((0.3, 0.7, 1.0, 1.6))]
        meta = build_sampling_metadata(params, [[1]] * 4, [[]] * 4,
                                       [torch.Generator().manual_seed(7 + i) for i in range(4)],
                                       None, 3000, torch.device("cpu"))
        got = Sampler()(logits, meta).sampled_token_ids
        u = torch.stack([torch.empty(1, dtype=torch.float64).uniform_(
            generator=torch.Generator().manual_seed(7 + i))[0] for i in range(4)])
        assert torch.equal(got, inverse_cdf(Sampler.probs(logits, meta), u)), extra


def test_a_sharp_temperature_on_huge_logits_still_draws_the_top_token():
    """Logits near 3e4 at temperature 1e-5 (a repetition penalty of 0.001 and a logit of 30
    make them): x * scale is near 3e9, where x * scale - max * scale contracted into an FMA
    left the top token exp(+-128), a row of zeros (token 0 drawn) or of infinities."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 255, generator=g) * 1e4
    u = torch.rand(64, dtype=torch.float64, generator=g)
    assert torch.equal(kernel(x, torch.full((64,), 1e5), u), x.argmax(dim=1))
