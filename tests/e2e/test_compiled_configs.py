"""Mode 3 across configurations users try: every serving shape after warm-up runs without a
compile or a Dynamo entry, and engines with different compile_sizes share one process.

Outputs are compared with a mode 0 engine on the same weights (test_compile_parity.py covers
the HF oracle). All engines share one module-scoped compile cache, so the range artifacts
compile once.
"""
import random

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.compilation.counters import compilation_counter

from checkpoints import make_tiny_checkpoint

# Compile and kernel counters, scheduler state: this process must run the core.
pytestmark = pytest.mark.usefixtures("inprocess_core")

MAX_TOKENS = 8  # max_num_batched_tokens: chunked prefill for longer prompts
MAX_SEQS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", tie=False)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("compile_cache"))


def _llm(model_dir, cache_dir, mode, **compilation):
    return LLM(model=str(model_dir), dtype="float32", max_num_batched_tokens=MAX_TOKENS,
               max_num_seqs=MAX_SEQS, max_model_len=45, kv_cache_memory=0.05,
               compilation_config={"mode": mode, "cache_dir": cache_dir, **compilation})


@pytest.fixture(scope="module")
def eager(model_dir, cache_dir):
    return _llm(model_dir, cache_dir, 0)


@pytest.fixture(scope="module")
def compiled(model_dir, cache_dir):
    # 3 > max_num_seqs (reached by prefill only), 8 == max_num_batched_tokens; given unsorted
    # and duplicated, which the config normalises to [1, 3, 8].
    return _llm(model_dir, cache_dir, 3, compile_sizes=[8, 1, 3, 8])


def _tokens(llm, prompts, **params):
    params = {"temperature": 0, "max_tokens": 3, "ignore_eos": True, **params}
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**params),
                        use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


def _dynamo_frames() -> int:
    return sum(torch._dynamo.utils.counters["frames"].values())


def test_every_serving_shape_runs_without_compiling(compiled, eager):
    rng = random.Random(0)
    word = lambda: rng.randrange(3, 500)  # noqa: E731
    batches = [[[word()] for _ in range(b)] for b in range(1, MAX_SEQS + 1)]  # decode sizes
    batches += [[[word() for _ in range(n)]] for n in range(1, MAX_TOKENS + 1)]  # prefill
    # staggered lengths: prefill chunks share steps with decodes, long prompts are chunked
    batches += [[[word() for _ in range(n)] for n in (1, 13, 4, 30)]]
    frames = _dynamo_frames()
    with compilation_counter.expect(num_inductor_compiles=0, num_backend_compilations=0,
                                    num_dynamo_traces=0, num_graphs_seen=0):
        got = [_tokens(compiled, prompts) for prompts in batches]
    assert _dynamo_frames() == frames
    assert got == [_tokens(eager, prompts) for prompts in batches]


def test_sampling_and_prompt_logprobs_match_eager(compiled, eager):
    """Seeded n > 1 sampling, logprobs and prompt logprobs over chunked prefill."""
    prompts = [[5, 9, 200, 31, 7, 7, 300, 12, 44, 45, 46, 3], [17, 18]]
    params = dict(temperature=0.8, n=2, seed=7, logprobs=3, prompt_logprobs=2, max_tokens=4)
    outs = [llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(**params), use_tqdm=False) for llm in (compiled, eager)]
    for a, b in zip(*outs):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for ca, cb in zip(a.outputs, b.outputs):
            for la, lb in zip(ca.logprobs, cb.logprobs):
                assert la.keys() == lb.keys()
                assert all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la)
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-4 for t in pa)


def test_engines_with_other_compile_sizes_share_the_process(model_dir, cache_dir, compiled,
                                                            eager):
    """A second engine (sizes [2]) compiles only its own size and serves alongside the first;
    a third with the first's config loads the saved graph: no trace, no compile."""
    prompts = [[4], [5, 6], [7, 8, 9], list(range(10, 30))]
    want = _tokens(eager, prompts)
    before = compilation_counter.clone()
    other = _llm(model_dir, cache_dir, 3, compile_sizes=[2])
    c = compilation_counter
    # the range artifacts load from the shared cache; only size 2 compiles (3 pieces, 2 layers)
    assert c.num_backend_compilations - before.num_backend_compilations == 3
    with compilation_counter.expect(num_inductor_compiles=0, num_dynamo_traces=0):
        assert _tokens(other, prompts) == want
        assert _tokens(compiled, prompts) == want
    with compilation_counter.expect(num_inductor_compiles=0, num_dynamo_traces=0,
                                    num_graphs_seen=0, num_saved_graph_loads=1):
        again = _llm(model_dir, cache_dir, 3, compile_sizes=[1, 3, 8])
    with compilation_counter.expect(num_inductor_compiles=0, num_dynamo_traces=0):
        assert _tokens(again, prompts) == want
        assert _tokens(other, prompts) == want
