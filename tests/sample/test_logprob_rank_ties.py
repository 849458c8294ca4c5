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


def test_sampled_token_in_the_top_n_takes_its_position_as_rank():
    """vLLM builds the position's dict from [sampled, top-1..top-N] with ranks [counted, 1..N]:
    a sampled token among the top-N ends with its top-N position (a later key wins), so a
    greedy token tied for the top shows rank 1 where it is listed first, its count (2) only
    where the top-N leaves it out."""
    from kiln.core.outputs import LogprobsLists
    from kiln.engine.output_processor import to_logprob_dict

    lp = _tied_logprobs()
    ids, lps, ranks = gather_logprobs(lp, torch.tensor([0, 1, 0]), 2)
    for row in range(3):
        lists = LogprobsLists(token_ids=ids[row].tolist(), logprobs=lps[row].tolist(),
                              sampled_rank=int(ranks[row]))
        got = to_logprob_dict(lists, str)
        sampled, top = lists.token_ids[0], lists.token_ids[1:]
        assert next(iter(got)) == sampled  # the sampled token stays first
        want = {sampled: lists.sampled_rank, **{t: i for i, t in enumerate(top, start=1)}}
        assert {t: p.rank for t, p in got.items()} == want
    # row 0: token 0 is tied for the top with 1 and 3, its count 3; listed first by topk
    lists = LogprobsLists(token_ids=[0, 0, 1], logprobs=lp[0, [0, 0, 1]].tolist(),
                          sampled_rank=3)
    assert {t: p.rank for t, p in to_logprob_dict(lists, str).items()} == {0: 1, 1: 2}
