"""Sampler tests: greedy, penalties and min_tokens through the sampler, seeded reproducibility
independent of batch composition, distribution sanity, and logprobs against log_softmax."""
import torch

from kiln.sample.row_reductions import count_at_least, row_argmax
from kiln.sample.sampler import Sampler
from kiln.sample.sampling_metadata import build_sampling_metadata
from kiln.sampling_params import SamplingParams

V = 32


def meta_for(params, prompts=None, outputs=None, seeds_gen=True, default_seed=0):
    n = len(params)
    prompts = prompts or [[1, 2, 3]] * n
    outputs = outputs or [[] for _ in range(n)]
    gens = [torch.Generator().manual_seed(p.seed) if (p.seed is not None and seeds_gen) else None
            for p in params]
    return build_sampling_metadata(params, prompts, outputs, gens,
                                   torch.Generator().manual_seed(default_seed), V,
                                   torch.device("cpu"))


def test_all_greedy_is_argmax_and_fast_path():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(1))
    meta = meta_for([SamplingParams(temperature=0)] * 5)
    assert meta.all_greedy and meta.no_penalties and meta.temperature is None
    out = Sampler()(logits, meta)
    assert torch.equal(out.sampled_token_ids, logits.argmax(1))
    assert out.logprobs is None


def test_mixed_greedy_and_random_rows():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=3)]
    out = Sampler()(logits, meta_for(params)).sampled_token_ids
    # top_k=1 at any temperature is greedy as well.
    assert out[:3].tolist() == logits[:3].argmax(1).tolist()


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.zeros(1, V)
    logits[0, 5], logits[0, 6] = 2.0, 1.5
    params = [SamplingParams(temperature=0, repetition_penalty=2.0)]
    out = Sampler()(logits, meta_for(params, prompts=[[5]])).sampled_token_ids
    assert out.tolist() == [6]  # 2.0 / 2 = 1.0 < 1.5


def test_frequency_penalty_ignores_prompt_tokens():
    logits = torch.zeros(2, V)
    logits[:, 5], logits[:, 6] = 2.0, 1.5
    params = [SamplingParams(temperature=0, frequency_penalty=1.0)] * 2
    out = Sampler()(logits, meta_for(params, prompts=[[5], [7]], outputs=[[], [5]]))
    assert out.sampled_token_ids.tolist() == [5, 6]


def test_min_tokens_masks_stop_tokens_until_reached():
    logits = torch.zeros(2, V)
    logits[:, 2] = 10.0  # eos is the clear favourite
    params = []
    for _ in range(2):
        p = SamplingParams(temperature=0, min_tokens=2)
        p.update_from_tokenizer(eos_token_id=2, vocab_size=V)
        params.append(p)
    out = Sampler()(logits, meta_for(params, outputs=[[7], [7, 8]])).sampled_token_ids
    assert out[0].item() != 2 and out[1].item() == 2
    assert logits[0, 2] == 10.0  # the model's logits are left untouched


def test_seeded_rows_reproducible_regardless_of_batch():
    g = torch.Generator().manual_seed(4)
    target = torch.randn(1, V, generator=g)
    others = torch.randn(6, V, generator=g)
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def run_steps(batch_logits, params, row, steps=8):
        meta = meta_for(params)  # generators persist across steps, as in the runner
        return [Sampler()(batch_logits, meta).sampled_token_ids[row].item() for _ in range(steps)]

    alone = run_steps(target, [seeded], row=0)
    crowd = run_steps(torch.cat([others[:3], target, others[3:]]),
                      [SamplingParams(temperature=1.0)] * 3 + [seeded]
                      + [SamplingParams(temperature=0.5, seed=9)] * 3, row=3)
    assert alone == crowd
    assert len(set(alone)) > 1  # it really samples


def test_unseeded_rows_follow_default_generator():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=1.0)] * 3
    a = Sampler()(logits, meta_for(params, default_seed=7)).sampled_token_ids
    b = Sampler()(logits, meta_for(params, default_seed=7)).sampled_token_ids
    assert torch.equal(a, b)


def test_sampling_distribution_matches_probs():
    logits = torch.tensor([[0.0, 1.0, 2.0] + [-1e9] * (V - 3)])
    meta = meta_for([SamplingParams(temperature=1.0)])
    n = 4000
    counts = torch.zeros(V)
    for _ in range(n):
        counts[Sampler()(logits, meta).sampled_token_ids[0]] += 1
    expected = logits.softmax(1)[0, :3]
    assert counts[3:].sum() == 0
    assert torch.allclose(counts[:3] / n, expected, atol=0.03)


def test_top_k_restricts_samples():
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(6))
    top2 = set(logits[0].topk(2).indices.tolist())
    meta = meta_for([SamplingParams(temperature=2.0, top_k=2)])
    seen = {Sampler()(logits, meta).sampled_token_ids[0].item() for _ in range(100)}
    assert seen == top2


def test_logprobs_from_raw_logits():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(8))
    params = [SamplingParams(temperature=0, logprobs=3, repetition_penalty=2.0),
              SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, logprobs=0, seed=1)]
    meta = meta_for(params, prompts=[[int(logits[0].argmax())], [1], [1]])
    out = Sampler()(logits, meta)
    from kiln.sample.logprobs import to_logprobs_lists
    lists = to_logprobs_lists(out.logprob_token_ids, out.logprobs, out.sampled_ranks,
                              meta.num_logprobs)
    ref = logits.log_softmax(1)
    assert lists[1] is None
    first = lists[0]
    sampled = out.sampled_token_ids[0].item()
    assert sampled != logits[0].argmax().item()  # the penalty moved the choice ...
    assert first.token_ids[0] == sampled
    assert abs(first.logprobs[0] - ref[0, sampled].item()) < 1e-5  # ... not the logprob
    assert first.token_ids[1:] == ref[0].topk(3).indices.tolist()
    assert torch.allclose(torch.tensor(first.logprobs[1:]), ref[0].topk(3).values)
    assert first.sampled_rank == int((ref[0] >= ref[0, sampled]).sum()) == 2
    third = lists[2]
    assert len(third.token_ids) == 1 and len(third.logprobs) == 1
    assert abs(third.logprobs[0] - ref[2, third.token_ids[0]].item()) < 1e-5


def test_row_argmax_matches_torch_ties_nan_and_inf():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 300, generator=g)
    x[1, [7, 200]] = 9.0  # a tie: the first wins
    x[2, 50], x[2, 10] = float("nan"), 1e30  # NaN counts as the largest
    x[3] = float("-inf")
    x[4, 299] = float("inf")
    for t in (x, x[:, ::2], x.to(torch.bfloat16), x[0:1]):
        got = row_argmax(t)
        assert got.dtype == torch.int64 and torch.equal(got, t.argmax(dim=1))


def test_count_at_least_matches_torch_on_cpu_and_other_dtypes():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 3000, generator=g)
    x[1, :10] = float("nan")
    x[2, 5] = float("inf")
    value = x[:, 7:8].clone()
    want = (x >= value).sum(dim=1)
    assert torch.equal(count_at_least(x, value), want)
    assert torch.equal(count_at_least(x.t().contiguous().t(), value), want)  # strided rows
    assert torch.equal(count_at_least(x.bfloat16(), value.bfloat16()),
                       (x.bfloat16() >= value.bfloat16()).sum(dim=1))
