"""Penalties and min_tokens through the whole sampler against a plain reference of vLLM's
semantics: repetition over prompt and output tokens (divide positive logits, multiply negative),
frequency per output occurrence, presence once per distinct output token, all before
temperature; min_tokens forbids eos and stop_token_ids until that many tokens are out."""
import math
from collections import Counter

import torch

from kiln.sample.sampler import Sampler
from kiln.sample.sampling_metadata import build_sampling_metadata
from kiln.sampling_params import SamplingParams

V = 50


def reference_penalized(logits, prompt, output, rep, presence, frequency):
    out = logits.double().clone()
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t, count in Counter(output).items():
        out[t] -= frequency * count + presence
    return out


def run(logits, params, prompts, outputs, seed=0):
    meta = build_sampling_metadata(params, prompts, outputs, [None] * len(params),
                                   torch.Generator().manual_seed(seed), logits.shape[1],
                                   torch.device("cpu"))
    return Sampler()(logits, meta).sampled_token_ids


def test_greedy_choice_matches_reference_over_random_batches():
    g = torch.Generator().manual_seed(0)

    def uniform(lo, hi):
        return float(torch.empty(1).uniform_(lo, hi, generator=g))

    def tokens():
        return torch.randint(0, V, (int(torch.randint(0, 12, (1,), generator=g)),),
                             generator=g).tolist()

    for trial in range(60):
        logits = torch.randn(5, V, generator=g) * 3
        params, prompts, outputs = [], [], []
        for i in range(5):
            plain = (trial + i) % 4 == 0  # a row without penalties rides along
            params.append(SamplingParams(
                temperature=0, repetition_penalty=1.0 if plain else uniform(0.5, 2.0),
                presence_penalty=0.0 if plain else uniform(-2, 2),
                frequency_penalty=0.0 if plain else uniform(-2, 2)))
            prompts.append(tokens())
            outputs.append(tokens())
        got = run(logits, params, prompts, outputs)
        for i, p in enumerate(params):
            ref = reference_penalized(logits[i], prompts[i], outputs[i], p.repetition_penalty,
                                      p.presence_penalty, p.frequency_penalty)
            assert got[i] == ref.argmax(), (trial, i)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    params = [SamplingParams(temperature=0, repetition_penalty=2.0)]
    logits = torch.tensor([[2.0, 1.5] + [-10.0] * (V - 2)])
    assert run(logits, params, [[0]], [[]]).tolist() == [1]  # 2.0 / 2 < 1.5 (prompt token)
    assert run(logits, params, [[]], [[0]]).tolist() == [1]  # output tokens as well
    logits = torch.tensor([[-0.2, -0.3] + [-10.0] * (V - 2)])
    assert run(logits, params, [[0]], [[]]).tolist() == [1]  # -0.2 * 2 < -0.3
    # Repeats do not compound: the penalty applies once per distinct token.
    logits = torch.tensor([[3.0, 1.4] + [-10.0] * (V - 2)])
    assert run(logits, params, [[0, 0]], [[0, 0]]).tolist() == [0]  # 3 / 2 > 1.4


def test_presence_and_frequency_count_output_tokens_only():
    logits = torch.zeros(1, V)
    logits[:, 4], logits[:, 5] = 3.0, 1.0
    freq = [SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.4)]
    assert run(logits, freq, [[4, 4, 4, 4]], [[]]).tolist() == [4]  # prompt: untouched
    assert run(logits, freq, [[]], [[4, 4, 4, 4]]).tolist() == [5]  # 3 - 2.0 - 0.4 < 1
    assert run(logits, freq, [[]], [[4, 4, 4]]).tolist() == [4]  # 3 - 1.5 - 0.4 > 1
    presence = [SamplingParams(temperature=0, presence_penalty=1.9)]
    # Once per distinct token: 3 - 1.9 > 1 however often 4 came out.
    assert run(logits, presence, [[]], [[4, 4, 4]]).tolist() == [4]
    assert run(logits, presence, [[]], [[4, 5]]).tolist() == [4]


def test_penalties_apply_before_temperature():
    """Draws follow softmax(penalized / T), not softmax(logits / T) penalized afterwards."""
    n, temperature = 8000, 0.5
    row = torch.randn(V, generator=torch.Generator().manual_seed(1))
    row[3] = -math.inf
    p = SamplingParams(temperature=temperature, repetition_penalty=1.5, presence_penalty=0.3,
                       frequency_penalty=0.5)
    prompt, output = [1, 2, 3], [2, 2, 4, 5]
    got = run(row.unsqueeze(0).expand(n, V).contiguous(), [p] * n, [prompt] * n,
              [output] * n)
    freq = torch.bincount(got, minlength=V).double() / n
    ref = (reference_penalized(row, prompt, output, 1.5, 0.3, 0.5) / temperature).softmax(0)
    m = ref > 0
    assert freq[~m].sum() == 0
    stat = ((freq[m] - ref[m]) ** 2 / ref[m]).sum().item() * n
    dof = int(m.sum()) - 1
    assert stat < dof + 6 * math.sqrt(2 * dof) + 10


def _with_stops(**kw):
    p = SamplingParams(**kw)
    p.update_from_tokenizer(eos_token_id=9, vocab_size=V)
    return p


def test_min_tokens_blocks_eos_and_stop_ids_until_reached():
    logits = torch.full((1, V), -5.0)
    logits[0, [7, 8, 9]] = 10.0
    p = _with_stops(temperature=1.0, min_tokens=3, stop_token_ids=[7, 8])
    n = 500
    many = logits.expand(n, V).contiguous()
    below = run(many, [p] * n, [[1]] * n, [[1, 2]] * n)
    assert not ((below == 7) | (below == 8) | (below == 9)).any()
    reached = run(many, [p] * n, [[1]] * n, [[1, 2, 3]] * n)
    assert set(reached.tolist()) == {7, 8, 9}


def test_min_tokens_holds_eos_back_under_ignore_eos_too():
    """As vLLM: ignore_eos makes eos an ordinary token once min_tokens are out, and min_tokens
    still holds it (and the model's other end tokens) back before that."""
    logits = torch.zeros(1, V)
    logits[0, [9, 11]] = 5.0
    p = SamplingParams(temperature=0, min_tokens=3, ignore_eos=True)
    p.update_from_tokenizer(eos_token_id=9, vocab_size=V, model_end_ids=[11])
    assert run(logits, [p], [[1]], [[]]).tolist() not in ([9], [11])
    assert run(logits, [p], [[1]], [[1, 2, 3]]).tolist() == [9]
    assert 9 not in p.all_stop_token_ids  # sampled, it does not end the request
