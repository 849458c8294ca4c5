"""Seeded random workloads on a real tiny Llama: a greedy request's output does not depend on the
batch around it or on how the engine scheduled it.

Requests arrive over random steps (prompts of 1-300 tokens, many sharing long prefixes) with
logprobs, prompt logprobs, stop ids and strings, min_tokens, n > 1, penalties and priorities,
some aborted mid-way, into an engine with a small budget (chunked prefill; or whole prompts,
--no-enable-chunked-prefill), few sequences, a cache barely one request long (preemption and
recompute), prefix caching, priority scheduling, n-gram speculation. Each finished request's
tokens, text, finish reason and logprobs must equal those of the same request run alone in a
roomy engine (no chunking, no prefix cache, no speculation), and every block must be free at
the end.
"""
import random

import pytest

from kiln import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("inprocess_core")  # reads the scheduler's stats

LOGPROB_TOL = 1e-3  # float32; the batch changes the kernels' shapes, not the math


def _workload(rng: random.Random, n_req: int) -> list[tuple[list[int], dict, int]]:
    prefixes = [[rng.randrange(3, 512) for _ in range(rng.randrange(100, 300))]
                for _ in range(3)]
    reqs = []
    for _ in range(n_req):
        r = rng.random()
        if r < 0.5:
            prompt = prefixes[rng.randrange(3)][:rng.randrange(1, 300)]
        elif r < 0.6:
            prompt = [5, 6, 7, 8] * rng.randrange(1, 30)  # repetitive: n-gram drafts accepted
        else:
            prompt = []
        prompt = (prompt + [rng.randrange(3, 512)
                            for _ in range(rng.choice([0, 1, 3, 10, 40]))])[:300]
        prompt = prompt or [rng.randrange(3, 512)]
        if reqs and rng.random() < 0.2:  # another's whole prompt: a full prefix-cache hit
            prompt = list(rng.choice(reqs)[0])
        kw = dict(temperature=0, max_tokens=rng.choice([1, 1, 2, 5, 12, 24, 40]),
                  ignore_eos=rng.random() < 0.7)
        if rng.random() < 0.5:
            kw["logprobs"] = rng.choice([0, 1, 3])
        if rng.random() < 0.25:
            kw["prompt_logprobs"] = rng.choice([0, 2])
        if rng.random() < 0.3:  # 40 of 509 ids: they fire
            kw["stop_token_ids"] = [rng.randrange(3, 512) for _ in range(40)]
        if rng.random() < 0.2:
            kw["stop"] = [f"w{rng.randrange(3, 60)}"]
            kw["include_stop_str_in_output"] = rng.random() < 0.5
        if rng.random() < 0.2:
            kw["min_tokens"] = rng.randrange(0, kw["max_tokens"] + 1)
        if rng.random() < 0.15:
            kw["n"] = rng.choice([2, 3])
        if rng.random() < 0.1:
            kw["repetition_penalty"] = 1.3
        if rng.random() < 0.1:
            kw["frequency_penalty"] = 0.5
        reqs.append((prompt, kw, rng.randrange(0, 3)))
    return reqs


def _engine_config(rng: random.Random, need: int, spec: bool, chunked: bool = True) -> dict:
    """`chunked=False`: --no-enable-chunked-prefill, the budget raised to max_model_len."""
    block = rng.choice([4, 8, 16])
    max_len = need + rng.choice([0, 5, 50])
    budget = rng.choice([8, 16, 33, 64, 512])
    if not chunked:
        budget = max(budget, max_len)
    cfg = dict(block_size=block, max_model_len=max_len, max_num_batched_tokens=budget,
               enable_prefix_caching=rng.random() < 0.6, max_num_seqs=rng.choice([1, 2, 3, 8]),
               # a cache about one longest request long: preemption and recompute
               num_gpu_blocks_override=-(-max_len // block) + rng.choice([0, 0, 1, 3, 100]),
               scheduling_policy=rng.choice(["fcfs", "priority"]))
    if budget < max_len:
        cfg["enable_chunked_prefill"] = True
    if not chunked:
        cfg["enable_chunked_prefill"] = False
    if spec:
        cfg["speculative_config"] = {"method": "ngram", "prompt_lookup_max": 3,
                                     "prompt_lookup_min": 1,
                                     "num_speculative_tokens": rng.choice([1, 3, 5])}
    return cfg


def _summary(out):
    def values(lps):
        return None if lps is None else [None if d is None else {t: v.logprob for t, v in d.items()}
                                         for d in lps]
    return ([(list(c.token_ids), c.text, c.finish_reason, c.stop_reason, values(c.logprobs))
             for c in out.outputs], values(out.prompt_logprobs))


def _assert_same(got, want, what):
    def close(a, b):
        return a is b is None or (a is not None and b is not None and len(a) == len(b) and all(
            x is y is None or (x is not None and y is not None and x.keys() == y.keys()
                               and all(abs(x[t] - y[t]) <= LOGPROB_TOL or x[t] == y[t]
                                       for t in x))
            for x, y in zip(a, b)))
    (samples, prompt_lps), (want_samples, want_prompt_lps) = got, want
    assert len(samples) == len(want_samples), what
    for sample, ref in zip(samples, want_samples):
        assert sample[:4] == ref[:4], what
        assert close(sample[4], ref[4]), f"{what}: logprobs"
    assert close(prompt_lps, want_prompt_lps), f"{what}: prompt logprobs"


def _run(llm, reqs, rng) -> tuple[dict, int]:
    """Add the requests over random steps and abort some mid-way; the finished ones' summaries."""
    engine = llm.llm_engine
    pending = list(range(len(reqs)))
    rng.shuffle(pending)
    doomed = {i for i in pending if rng.random() < 0.15}
    live, aborted, done, steps = set(), set(), {}, 0
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.choice([0, 1, 1, 2, 5]) if steps else rng.randrange(1, 6)):
            if pending:
                i = pending.pop()
                prompt, kw, priority = reqs[i]
                engine.add_request(str(i), {"prompt_token_ids": prompt}, SamplingParams(**kw),
                                   priority=priority)
                live.add(i)
        for i in sorted(live & doomed):
            if rng.random() < 0.3:
                engine.abort_request(str(i))
                aborted.add(i)
                live.discard(i)
        for out in engine.step():
            if out.finished and int(out.request_id) not in aborted:
                done[int(out.request_id)] = _summary(out)
                live.discard(int(out.request_id))
        steps += 1
        assert steps < 5000, "the engine stopped making progress"
    return done, len(aborted)


@pytest.fixture(scope="module")
def alone(tiny_llama_dir):
    """Each request run by itself in a roomy engine: no chunking, no prefix cache."""
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", enforce_eager=True, max_model_len=384,
              enable_prefix_caching=False, max_num_batched_tokens=512, max_num_seqs=8)
    memo = {}

    def run(prompt, kw):
        key = (tuple(prompt), repr(sorted(kw.items())))
        if key not in memo:
            memo[key] = _summary(llm.generate([{"prompt_token_ids": prompt}],
                                              SamplingParams(**kw), use_tqdm=False)[0])
        return memo[key]
    return run


def check_seed(model_dir, alone, seed: int, spec: bool = False, n_req: int = 16,
               chunked: bool = True):
    """Run seed's workload and engine; returns the engine's stats and how many were aborted."""
    rng = random.Random(seed)
    reqs = _workload(rng, n_req)
    cfg = _engine_config(rng, max(len(p) + kw["max_tokens"] for p, kw, _ in reqs), spec,
                         chunked)
    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, **cfg)
    done, num_aborted = _run(llm, reqs, rng)
    for i, got in done.items():
        _assert_same(got, alone(*reqs[i][:2]), f"seed {seed} request {i} {reqs[i][1]} {cfg}")
    stats = llm.llm_engine.engine_core.core.make_stats()
    assert stats.num_free_blocks == cfg["num_gpu_blocks_override"], f"seed {seed}: blocks leaked"
    return stats, num_aborted


# Seeds whose engines preempt and hit the prefix cache; 72 chunks prefills and serves a prompt
# logprobs request whose prompt another left cached, 71 speculates and aborts requests (and
# without chunked prefill, whole prompts only).
@pytest.mark.parametrize("seed,spec,chunked", [(72, False, True), (71, True, True),
                                               (71, True, False)])
def test_outputs_do_not_depend_on_the_batch(tiny_llama_dir, alone, seed, spec, chunked):
    stats, num_aborted = check_seed(tiny_llama_dir, alone, seed, spec, n_req=10,
                                    chunked=chunked)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert not spec or (stats.spec_decode_num_accepted_tokens > 0 and num_aborted > 0)


@pytest.mark.slow
@pytest.mark.parametrize("spec", [False, True])
@pytest.mark.parametrize("chunked", [True, False])
def test_outputs_do_not_depend_on_the_batch_many_seeds(tiny_llama_dir, alone, spec, chunked):
    for seed in range(1000, 1030):
        check_seed(tiny_llama_dir, alone, seed, spec, chunked=chunked)
