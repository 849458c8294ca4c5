"""A token's logprob rank counts the tokens whose logprob is >= its own, as vLLM's
batched_count_greater_than does ((x >= value).sum()): a tie counts against the token. Kiln
gave the best rank among ties (1 for each of two tokens tied for the top; vLLM says 2)."""
import torch

from kiln.sample.logprobs import gather_logprobs
from kiln.sample.prompt_logprobs import compute_prompt_logprobs


def _tied_logprobs() -> torch.Tensor:
    logits = torch.tensor([[3.0, 3.0, 1.0, 3.0, 0.0, 1.0],  # three tied for the top
                           [0.0, 2.0, 1.0, 1.0, 1.0, -1.0],  # three tied second
                           [5.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    return logits.log_softmax(dim=1)


def test_sampled_token_ranks_count_ties_against_it():
    lp = _tied_logprobs()
    _, _, ranks = gather_logprobs(lp, torch.tensor([1, 3, 0]), 2)
    assert ranks.tolist() == [3, 4, 1]
    _, _, ranks = gather_logprobs(lp.bfloat16(), torch.tensor([0, 2, 5]), 2)  # torch's path
    assert ranks.tolist() == [3, 4, 6]


def test_prompt_token_ranks_count_ties_against_it():
    lp = _tied_logprobs()
    entries = compute_prompt_logprobs(lambda rows: rows, lp, targets=[3, 4, 1], num_logprobs=1,
                                      vocab_size=6)
    assert [e.sampled_rank for e in entries] == [3, 4, 6]
