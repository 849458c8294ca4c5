"""Drawing one index per row of a probability table from one uniform number per row, by
inverting the row's cumulative distribution in two levels (blocks, then one block's entries).

It replaced an exponential race (argmax of p / q, q ~ Exp(1) per entry): drawing a vocabulary's
worth of exponentials cost more than a decode step's attention on CPU (figures:
docs/measurements.md); this takes one uniform a row and two short scans. On CPU, `sample_rows`
runs it fused with the softmax in one kernel (csrc/sample_rows.c): no probability table.
"""
import torch
import torch.nn.functional as F

from kiln.native import build

BLOCK = 256  # entries summed together at the first level


def _last_positive(x: torch.Tensor) -> torch.Tensor:
    """Per row of x [N, M], the index of its last entry above 0 (0 when there is none)."""
    cols = torch.arange(x.shape[1], device=x.device).expand_as(x)
    return torch.where(x > 0, cols, 0).amax(dim=1)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For probs [N, V] (non-negative, any total) and u [N] in [0, 1): per row the index i with
    cdf(i - 1) <= u * total < cdf(i) (int64 [N]), so P(i) = probs[i] / total; an entry of 0 is
    never drawn. Sums are float64. Rows whose total is not a positive number get index 0."""
    n, vocab = probs.shape
    pad = (-vocab) % BLOCK
    blocks = (F.pad(probs, (0, pad)) if pad else probs).reshape(n, -1, BLOCK)  # [N, B, BLOCK]
    block_sums = blocks.sum(dim=2, dtype=torch.float64)  # [N, B]
    cdf = block_sums.cumsum(dim=1)  # [N, B]
    target = u.to(torch.float64) * cdf[:, -1]  # [N]
    # The first block whose cdf passes the target; rounding could give one past the last block
    # with mass, which is taken instead.
    b = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    b = torch.minimum(b, _last_positive(block_sums))
    before = torch.where(b > 0, cdf.gather(1, (b - 1).clamp_min(0).unsqueeze(1)).squeeze(1), 0.)
    rows = torch.arange(n, device=probs.device)
    inner = blocks[rows, b]  # [N, BLOCK]
    inner_cdf = inner.to(torch.float64).cumsum(dim=1)
    j = torch.searchsorted(inner_cdf, (target - before).unsqueeze(1), right=True).squeeze(1)
    j = torch.minimum(j, _last_positive(inner))
    return b * BLOCK + j


def kernel_draws(device: torch.device, dtype: torch.dtype, built: bool) -> bool:
    """Whether sample_rows runs Kiln's CPU kernel: float32 logits on the CPU, the kernels built."""
    return device.type == "cpu" and dtype == torch.float32 and built


def sample_rows(logits: torch.Tensor, scale: torch.Tensor | None,
                u: torch.Tensor) -> torch.Tensor:
    """inverse_cdf(softmax(logits * scale[:, None]), u) for logits [N, V], scale [N] float32 (None:
    1) and u [N] float64 in [0, 1) -> int64 [N]. The kernel sums exp(x * scale - max) without the
    softmax's division and rounding: the same draw except where u falls within rounding of a
    token's edge."""
    if kernel_draws(logits.device, logits.dtype, build.available()):
        if scale is None:
            scale = logits.new_ones(logits.shape[0])
        return torch.ops.kiln.sample_rows_native(logits, scale.float(), u.to(torch.float64))
    scaled = logits if scale is None else logits * scale.unsqueeze(1)
    return inverse_cdf(scaled.softmax(dim=1, dtype=torch.float32), u)
