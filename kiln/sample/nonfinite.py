"""Logits a broken model made non-finite: NaN entries are never sampled, a row with +inf entries
samples only those; the rows hit are logged (loudly, not per step) and reported to the caller.
"""
import torch

from kiln.logger import init_logger
from kiln.sample.row_reductions import has_nan_or_posinf

logger = init_logger(__name__)

_NEG_INF = float("-inf")
_times_seen = 0


def sanitize_logits(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of logits [N, V] where NaN is -inf and, in rows holding +inf, +inf is 0 and the
    rest -inf (a float16 overflow: the overflowing tokens are the likeliest, equally), and the
    bool [N] of rows that held either. A row left without a finite entry samples token 0."""
    nan = logits.isnan()  # [N, V]
    posinf = logits == float("inf")  # [N, V]
    inf_rows = posinf.any(dim=1, keepdim=True)  # [N, 1]
    clean = logits.masked_fill(nan, _NEG_INF)
    clean = torch.where(inf_rows, torch.where(posinf, 0.0, _NEG_INF), clean)
    bad_rows = nan.any(dim=1) | inf_rows.squeeze(1)  # [N]
    _warn(bad_rows, int(nan.sum()), int(posinf.sum()))
    return clean, bad_rows


def finite_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax of logits [N, V] with no NaN: non-finite logits sanitized as above, and a row
    left with nothing finite gets -inf throughout (its log_softmax is NaN)."""
    if not has_nan_or_posinf(logits):
        return logits.log_softmax(dim=1)
    logits, _ = sanitize_logits(logits)
    return log_softmax_of_sanitized(logits)


def log_softmax_of_sanitized(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax of logits [N, V] holding no NaN or +inf (rows of -inf only give -inf)."""
    return logits.log_softmax(dim=1).nan_to_num(nan=_NEG_INF, neginf=_NEG_INF)


def _warn(bad_rows: torch.Tensor, num_nan: int, num_posinf: int) -> None:
    """Warn at the 1st, 2nd, 4th, 8th... step with non-finite logits: loud, not a flood."""
    global _times_seen
    _times_seen += 1
    if _times_seen & (_times_seen - 1):
        return
    rows = bad_rows.nonzero().squeeze(1).tolist()
    logger.warning(
        "Non-finite logits (step %d with them so far): %d NaN and %d +inf entries in batch rows "
        "%s of %d. NaN tokens are not sampled, +inf ones always; a row with nothing finite "
        "samples token 0 and its logprobs are -inf. The model's numerics are broken: a float16 "
        "checkpoint may overflow (try --dtype bfloat16), or the weights hold NaN.",
        _times_seen, num_nan, num_posinf, rows, bad_rows.numel())
