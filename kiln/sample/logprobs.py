"""Logprobs of the sampled token and the top-N alternatives, from the raw model distribution.

As in vLLM's default, they come from the logits before penalties, temperature or filters. A token
the model rules out (a -inf or NaN logit) has logprob -inf, never NaN; the OpenAI server prints
-inf as -9999, as vLLM's does.
"""
import torch

from kiln.core.outputs import LogprobsLists
from kiln.sample.row_reductions import count_at_least


def gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor,
                    max_num_logprobs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: ids [N, 1 + K] and logprobs [N, 1 + K] (column 0 the sampled token, then the
    top-K), and the sampled token's 1-based rank [N]. raw_logprobs [N, V], sampled [N]."""
    sampled_lp = raw_logprobs.gather(1, sampled.unsqueeze(1))  # [N, 1]
    top_lp, top_ids = raw_logprobs.topk(max_num_logprobs, dim=1)  # [N, K]
    # vLLM's rank: the tokens at least as likely, itself included (a tie counts against it,
    # so two tokens tied for the top both rank 2)
    ranks = count_at_least(raw_logprobs, sampled_lp)  # [N]
    ids = torch.cat([sampled.unsqueeze(1), top_ids], dim=1)
    lps = torch.cat([sampled_lp, top_lp], dim=1)
    return ids, lps, ranks


def to_logprobs_lists(ids: torch.Tensor, lps: torch.Tensor, ranks: torch.Tensor,
                      num_logprobs: list[int | None]) -> list[LogprobsLists | None]:
    """One `LogprobsLists` per row that asked for logprobs (None for the others)."""
    ids_l, lps_l, ranks_l = ids.tolist(), lps.tolist(), ranks.tolist()
    out: list[LogprobsLists | None] = []
    for i, k in enumerate(num_logprobs):
        if k is None:
            out.append(None)
        else:
            out.append(LogprobsLists(token_ids=ids_l[i][:1 + k], logprobs=lps_l[i][:1 + k],
                                     sampled_rank=int(ranks_l[i])))
    return out
