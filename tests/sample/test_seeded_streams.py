"""A seeded request's tokens depend only on its own logits, settings and seed: not on which other
requests share its batch, their order, settings or broken logits; and the samples of an n > 1
request (seeds seed + i, as the engine gives them) follow distinct streams."""
import random

import torch

from kiln.sample.sampler import Sampler
from kiln.sample.sampling_metadata import build_sampling_metadata
from kiln.sampling_params import SamplingParams

V = 300
_g = torch.Generator().manual_seed(5)
ROWS = torch.randn(7, V, generator=_g) * 2
ROWS[6, 10:20] = float("nan")  # a broken request sharing the batch
PARAMS = [SamplingParams(temperature=0.7, top_k=10, seed=11),
          SamplingParams(temperature=0),
          SamplingParams(temperature=1.2, top_p=0.5, seed=12),
          SamplingParams(temperature=1.0, min_p=0.2, seed=13, repetition_penalty=1.3),
          SamplingParams(temperature=0.9, seed=14, presence_penalty=1.0, frequency_penalty=0.5),
          SamplingParams(temperature=1.0),  # unseeded: the engine's default generator
          SamplingParams(temperature=1.0, seed=16)]
PROMPTS = [[1, 2], [3], [4, 5, 6], [7], [8, 9], [10], [11]]
OUTPUTS = [[11], [], [12, 13], [14, 14], [15, 15, 15], [], [16]]


def streams(order: list[int], steps: int = 16) -> dict[int, list[int]]:
    """Tokens of each request over `steps` steps of a batch of requests `order`; generators
    live across steps, as the runner keeps them."""
    gens = [torch.Generator().manual_seed(PARAMS[i].seed) if PARAMS[i].seed is not None
            else None for i in order]
    meta = build_sampling_metadata([PARAMS[i] for i in order], [PROMPTS[i] for i in order],
                                   [OUTPUTS[i] for i in order], gens,
                                   torch.Generator().manual_seed(0), V, torch.device("cpu"))
    sampler = Sampler()
    steps_out = [sampler(ROWS[order], meta).sampled_token_ids.tolist() for _ in range(steps)]
    return {r: [s[j] for s in steps_out] for j, r in enumerate(order)}


def test_seeded_requests_ignore_their_batch():
    seeded = [i for i, p in enumerate(PARAMS) if p.seed is not None or p.temperature == 0]
    alone = {i: streams([i])[i] for i in seeded}
    assert all(len(set(alone[i])) > 1 for i in (2, 4))  # they really sample
    rng = random.Random(0)
    for _ in range(8):
        order = rng.sample(range(len(PARAMS)), rng.randint(2, len(PARAMS)))
        got = streams(order)
        for i in order:
            if i in alone:
                assert got[i] == alone[i], (order, i)


def test_samples_of_an_n_request_follow_distinct_streams():
    base = SamplingParams(temperature=1.0, seed=100)
    row = torch.zeros(1, 64)  # uniform: any stream is as likely as any other
    runs = []
    for index in range(3):
        child = base.clone()
        child.seed = base.seed + index
        meta = build_sampling_metadata([child], [[1]], [[]],
                                       [torch.Generator().manual_seed(child.seed)],
                                       torch.Generator().manual_seed(0), 64,
                                       torch.device("cpu"))
        runs.append([Sampler()(row, meta).sampled_token_ids.item() for _ in range(12)])
    assert len({tuple(r) for r in runs}) == 3
