"""Speculative decoding with a draft model (vLLM's method='draft_model') end to end on tiny
random checkpoints: under temperature 0 the output is the one without speculation and HF's,
token for token and logprob for logprob, whether the draft is the target's own checkpoint (every
draft accepted, which also shows the draft's own KV cache kept up through chunked prefill,
preemption and prefix-cache hits) or a smaller random one (few accepted); sampling keeps the
target distribution."""
import pytest

from kiln import SamplingParams

from .test_spec_decode_e2e import PROMPTS, generate, make, spec_totals


def draft_spec(model_dir, k=3) -> dict:
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory):
    """A smaller random llama (1 layer, other head counts, another seed): its KV tensors differ
    in shape from the target's."""
    from checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("draft"), "llama", tie=False, seed=1,
                                num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                num_key_value_heads=1)


@pytest.fixture(scope="module")
def engines(inprocess_core, tiny_llama_dir, other_draft_dir):
    return (make(tiny_llama_dir, draft_spec(tiny_llama_dir)),
            make(tiny_llama_dir, draft_spec(other_draft_dir)), make(tiny_llama_dir, None))


def all_accepted(llm, before: dict) -> int:
    """Asserts every draft since `before` was accepted; returns how many there were."""
    after = spec_totals(llm)
    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = after["spec_decode_num_accepted_tokens"] - \
        before["spec_decode_num_accepted_tokens"]
    assert drafted > 0 and accepted == drafted, (accepted, drafted)
    return drafted


def assert_same(got, want, logprobs=False):
    assert [list(o.token_ids) for o in got] == [list(o.token_ids) for o in want]
    if logprobs:
        for g, w in zip(got, want):
            assert len(g.logprobs) == len(w.logprobs)
            for lg, lw in zip(g.logprobs, w.logprobs):
                assert lg.keys() == lw.keys()
                for token in lw:
                    assert lg[token].logprob == pytest.approx(lw[token].logprob, abs=1e-4)


def test_greedy_is_without_speculation_with_either_draft(engines):
    """(Without speculation these are HF's tokens: test_spec_decode_e2e.py; with a draft in
    mode 3, test_mode_3_compiles_the_draft_and_a_restart_traces_nothing.)"""
    same, other, base = engines
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    want = generate(base, PROMPTS, params)
    before = spec_totals(same)
    assert_same(generate(same, PROMPTS, params), want, logprobs=True)
    # the target's own checkpoint proposes what the target picks: all accepted, 3 a step
    assert all_accepted(same, before) >= 3 * 3 * 5
    # a prompt running into that output hits the blocks drafted steps filled, in both caches
    longer = [PROMPTS[0] + list(want[0].token_ids)[:18]]
    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    hits, before = same.llm_engine.get_stats()["prefix_cache_hits"], spec_totals(same)
    assert_same(generate(same, longer, short), generate(base, longer, short))
    all_accepted(same, before)
    assert same.llm_engine.get_stats()["prefix_cache_hits"] - hits >= 32
    before = spec_totals(other)
    assert_same(generate(other, PROMPTS, params), want, logprobs=True)
    after = spec_totals(other)
    assert after["spec_decode_num_drafts"] > before["spec_decode_num_drafts"]
    assert after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"] \
        < (after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]) / 2


def test_stops_lengths_and_n_are_those_without_speculation(engines):
    same, other, base = engines
    prompt = PROMPTS[1]
    full = generate(base, [prompt], SamplingParams(temperature=0, max_tokens=16,
                                                   ignore_eos=True))[0]
    cases = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1)
             for n in (1, 2, 3, 5)]
    cases += [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[t])
              for t in list(dict.fromkeys(full.token_ids))[:3]]
    cases += [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[w],
                             include_stop_str_in_output=inc)
              for w in list(dict.fromkeys(full.text.split()))[1:3] for inc in (False, True)]
    # min_tokens holds back a stop token the draft proposes: rejected, the output unchanged
    cases += [SamplingParams(temperature=0, max_tokens=16, min_tokens=6, ignore_eos=True,
                             stop_token_ids=[full.token_ids[2]])]
    want = generate(base, [prompt] * len(cases), cases)
    for llm in (same, other):
        before = spec_totals(llm)
        got = generate(llm, [prompt] * (len(cases) - 1), cases[:-1])
        if llm is same:
            all_accepted(llm, before)
        got += generate(llm, [prompt], cases[-1:])
        for g, w, p in zip(got, want, cases):
            assert (list(g.token_ids), g.text, g.finish_reason, g.stop_reason,
                    len(g.logprobs or ())) == (list(w.token_ids), w.text, w.finish_reason,
                                               w.stop_reason, len(w.logprobs or ())), p
    # n > 1 (greedy: every sample the same) and a seeded sample that repeats itself
    n3 = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=3)
    outs = same.generate([{"prompt_token_ids": prompt}], n3, use_tqdm=False)[0].outputs
    assert [list(o.token_ids) for o in outs] == [list(full.token_ids[:12])] * 3
    seeded = [SamplingParams(temperature=0.8, max_tokens=16, seed=s, ignore_eos=True)
              for s in range(3)]
    assert_same(generate(other, [prompt] * 3, seeded), generate(other, [prompt] * 3, seeded))


def test_chunked_prefill_preemption_context_end_and_prefix_hits_keep_every_draft(
        inprocess_core, engines, tiny_llama_dir):
    """A small budget (prefills in chunks beside drafted decodes), a cache of few blocks
    (preemptions of drafted requests, recomputed from scratch) and the context's
    end: the draft's cache follows the target's, so its own checkpoint's drafts are still all
    accepted, and the tokens are those without speculation."""
    _, _, base = engines
    tight = make(tiny_llama_dir, draft_spec(tiny_llama_dir), max_model_len=64,
                 max_num_batched_tokens=8, max_num_seqs=4, num_gpu_blocks_override=24,
                 block_size=4)
    prompts = [p[:30] for p in PROMPTS[:2]] * 2
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, logprobs=1)
    before = spec_totals(tight)
    got = generate(tight, prompts, params)
    want = generate(base, prompts, params)
    all_accepted(tight, before)
    stats = tight.llm_engine.get_stats()
    assert stats["num_preemptions"] > 0
    for g, w, p in zip(got, want, prompts):
        n = 64 - len(p)  # the context ends first
        assert list(g.token_ids) == list(w.token_ids)[:n] and g.finish_reason == "length"
        assert len(g.logprobs) == n


def test_sampling_keeps_the_target_distribution(engines):
    """The token verified at the first drafted position (the second token) follows the
    target's top-5 distribution after the first token (chi-square, 4 degrees of freedom)."""
    import math

    same, _, base = engines
    prompt = PROMPTS[2]
    params = [SamplingParams(temperature=1.0, top_k=5, max_tokens=3, seed=s, ignore_eos=True)
              for s in range(400)]
    before = spec_totals(same)
    outs = generate(same, [prompt] * len(params), params)
    assert spec_totals(same)["spec_decode_num_drafts"] > before["spec_decode_num_drafts"]
    firsts = [o.token_ids[0] for o in outs]
    first = max(set(firsts), key=firsts.count)
    seconds = [o.token_ids[1] for o in outs if o.token_ids[0] == first]
    assert len(seconds) > 100
    # the target's distribution there: its top 5 raw logprobs, renormalised
    (lp,) = generate(base, [prompt + [first]], SamplingParams(temperature=0, max_tokens=1,
                                                              logprobs=5))[0].logprobs
    top = {t: math.exp(v.logprob) for t, v in lp.items()}
    top = dict(sorted(top.items(), key=lambda kv: -kv[1])[:5])
    total = sum(top.values())
    assert set(seconds) <= set(top)
    chi2 = sum((seconds.count(t) - len(seconds) * p / total) ** 2 / (len(seconds) * p / total)
               for t, p in top.items())
    assert chi2 < 18.47, (chi2, top, seconds)  # the 0.999 quantile at 4 degrees of freedom


def test_mode_3_compiles_the_draft_and_a_restart_traces_nothing(inprocess_core, tiny_llama_dir,
                                                                tmp_path):
    """Under mode 3 the draft (the target's own checkpoint, under its own cache key) is traced
    and compiled at warm-up beside the target, then a second engine on the same cache loads
    both saved graphs; neither compiles while serving. A small budget chunks the prefills, so
    a draft catch-up runs a full step's tokens plus each request's sampled one."""
    from kiln.compilation.counters import compilation_counter as c

    from checkpoints import hf_greedy

    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = hf_greedy(tiny_llama_dir, PROMPTS, 20)
    cache = {"cache_dir": str(tmp_path / "cc")}
    for counts in ({"num_dynamo_traces": 2, "num_saved_graph_loads": 0},
                   {"num_dynamo_traces": 0, "num_saved_graph_loads": 2}):
        with c.expect(**counts):
            llm = make(tiny_llama_dir, draft_spec(tiny_llama_dir, k=2), mode=3,
                       compilation=cache, max_num_batched_tokens=16, max_num_seqs=4)
        assert llm.llm_engine.engine_core.executor.worker.model_runner.drafter.compiles
        before = spec_totals(llm)
        with c.expect(num_dynamo_traces=0, num_backend_compilations=0):  # none while serving
            outs = generate(llm, PROMPTS, params)
        all_accepted(llm, before)
        assert [list(o.token_ids) for o in outs] == want
        llm.llm_engine.shutdown()


def test_draft_counters_reach_the_spec_decoding_line(engines, kiln_logs):
    same, _, _ = engines
    generate(same, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    same.llm_engine.do_log_stats()
    (line,) = [r.getMessage() for r in kiln_logs.records
               if r.getMessage().startswith("SpecDecoding metrics: ")]
    totals = spec_totals(same)  # the line's window: since the engine started
    assert (f"Accepted: {totals['spec_decode_num_accepted_tokens']} tokens, Drafted: "
            f"{totals['spec_decode_num_draft_tokens']} tokens") in line



def test_a_shorter_draft_stops_drafting_past_its_length(engines, tiny_llama_dir, tmp_path):
    """A draft whose max_position_embeddings (24) is below --max-model-len was refused; as
    vLLM it is capped at its length, and a request past it goes on without drafts. The draft is
    the target's own weights, so every draft it makes is accepted."""
    from checkpoints import make_tiny_checkpoint

    short = make_tiny_checkpoint(tmp_path / "short", "llama", tie=False,
                                 max_position_embeddings=24)
    llm = make(tiny_llama_dir, draft_spec(short))
    try:
        base = engines[2]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        # 21 prompt tokens: drafted once (3 at positions 22..24), then past 24 no more
        before = spec_totals(llm)
        assert_same(generate(llm, [PROMPTS[2]], params), generate(base, [PROMPTS[2]], params))
        after = spec_totals(llm)
        assert after["spec_decode_num_draft_tokens"] - \
            before["spec_decode_num_draft_tokens"] == 3
        assert after["spec_decode_num_accepted_tokens"] - \
            before["spec_decode_num_accepted_tokens"] == 3
        # a 30-token prompt is past it from the start: never drafted, the same tokens
        assert_same(generate(llm, [PROMPTS[0]], params), generate(base, [PROMPTS[0]], params))
        assert spec_totals(llm)["spec_decode_num_drafts"] == after["spec_decode_num_drafts"]
    finally:
        llm.llm_engine.shutdown()
