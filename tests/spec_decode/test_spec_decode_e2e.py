"""N-gram speculative decoding end to end on a tiny random checkpoint: under temperature 0 the
output is the one without speculation, token for token and logprob for logprob (and HF's
greedy), with drafts accepted; stops and lengths that fall inside an accepted run cut it."""
import pytest

from kiln import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}
# repetitive prompts: the random model soon repeats itself too, so drafts get accepted
PROMPTS = [[5, 6, 7, 8, 9] * 6, list(range(10, 30)) * 2, [40, 41, 42, 43] * 5 + [44]]


def make(model_dir, spec, mode=0, compilation=None, **kwargs):
    compilation = {**({"mode": mode, "backend": "eager"} if mode == 3 else {"mode": mode}),
                   **(compilation or {})}
    kwargs.setdefault("max_model_len", 256)
    return LLM(model=str(model_dir), dtype="float32", compilation_config=compilation,
               speculative_config=spec, **kwargs)


@pytest.fixture(scope="module")
def engines(inprocess_core, tiny_llama_dir):  # in-process: no core process to start per engine
    return make(tiny_llama_dir, SPEC), make(tiny_llama_dir, None)


def generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def spec_totals(llm) -> dict:
    stats = llm.llm_engine.get_stats()
    return {k: stats[k] for k in stats if k.startswith("spec_decode_")}


def test_greedy_output_and_logprobs_are_those_without_speculation(engines, tiny_llama_dir):
    from checkpoints import hf_greedy

    spec, base = engines
    before = spec_totals(spec)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    got, want = generate(spec, PROMPTS, params), generate(base, PROMPTS, params)
    after = spec_totals(spec)
    assert after["spec_decode_num_drafts"] > before["spec_decode_num_drafts"]
    assert after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"] \
        >= 5
    assert [list(o.token_ids) for o in got] == [list(o.token_ids) for o in want] \
        == hf_greedy(tiny_llama_dir, PROMPTS, 24)
    for g, w in zip(got, want):
        assert len(g.logprobs) == len(w.logprobs) == 24
        for lg, lw in zip(g.logprobs, w.logprobs):
            assert lg.keys() == lw.keys()  # the emitted token and the same top 3
            for token in lw:
                assert lg[token].logprob == pytest.approx(lw[token].logprob, abs=1e-4)
                assert lg[token].rank == lw[token].rank


def test_penalties_bias_and_min_tokens_apply_per_position(engines):
    spec, base = engines
    # a frequency penalty counts the accepted drafts before each position (without them
    # the first prompt's output differed at 0.1 and 0.2)
    cases = [SamplingParams(temperature=0, max_tokens=24, frequency_penalty=f)
             for f in (0.1, 0.2)]
    cases += [SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.05),
              SamplingParams(temperature=0, max_tokens=20, frequency_penalty=0.4,
                             presence_penalty=0.2),
              SamplingParams(temperature=0, max_tokens=20, logit_bias={7: 3.0, 9: -5.0}),
              SamplingParams(temperature=0, max_tokens=20, min_tokens=12,
                             stop_token_ids=[6, 7, 8])]
    before = spec_totals(spec)["spec_decode_num_accepted_tokens"]
    for i, params in enumerate(cases):
        got = generate(spec, PROMPTS, params)
        want = generate(base, PROMPTS, params)
        assert [list(o.token_ids) for o in got] == [list(o.token_ids) for o in want], params
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
        if i == 1:
            assert spec_totals(spec)["spec_decode_num_accepted_tokens"] > before


def test_stops_and_max_tokens_inside_an_accepted_run(engines):
    spec, base = engines
    prompt = PROMPTS[0]
    full = generate(base, [prompt], SamplingParams(temperature=0, max_tokens=24,
                                                   ignore_eos=True))[0]
    before = spec_totals(spec)["spec_decode_num_accepted_tokens"]
    # every length: most end inside a run of accepted drafts
    lengths = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1)
               for n in range(1, 25)]
    outs = generate(spec, [prompt] * len(lengths), lengths)
    assert spec_totals(spec)["spec_decode_num_accepted_tokens"] > before
    for n, out in enumerate(outs, start=1):
        assert list(out.token_ids) == list(full.token_ids[:n])
        assert out.finish_reason == "length" and len(out.logprobs) == n
    # a stop token at each distinct place; a stop string at each word
    stops = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[t])
             for t in dict.fromkeys(full.token_ids)]
    # min_tokens holding a stop token back until a position inside a run of drafts
    stops += [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, min_tokens=m,
                             stop_token_ids=[full.token_ids[2]]) for m in range(1, 9)]
    words = list(dict.fromkeys(full.text.split()))[:8]
    stops += [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[w])
              for w in words]
    got = generate(spec, [prompt] * len(stops), stops)
    want = generate(base, [prompt] * len(stops), stops)
    for g, w, p in zip(got, want, stops):
        assert (list(g.token_ids), g.text, g.finish_reason, g.stop_reason) == \
            (list(w.token_ids), w.text, w.finish_reason, w.stop_reason), p


def test_seeded_sampling_repeats_and_accepts_drafts(engines):
    spec, _ = engines
    before = spec_totals(spec)["spec_decode_num_accepted_tokens"]
    params = [SamplingParams(temperature=0.3, top_p=0.9, max_tokens=24, seed=s,
                             ignore_eos=True, logprobs=1) for s in range(4)]
    first = generate(spec, PROMPTS[:1] * 4, params)
    again = generate(spec, PROMPTS[:1] * 4, params)
    assert [list(o.token_ids) for o in first] == [list(o.token_ids) for o in again]
    assert all(len(o.token_ids) == len(o.logprobs) == 24 for o in first)
    assert spec_totals(spec)["spec_decode_num_accepted_tokens"] > before


def test_small_budget_small_cache_and_context_end_change_no_token(engines, tiny_llama_dir):
    """Drafts cut to the step's token budget, preemptions of drafted requests (a cache of few
    blocks), chunked prefill, the context's end and prefix-cache hits on blocks computed with
    drafts: the tokens are those without speculation."""
    _, base = engines
    tight = make(tiny_llama_dir, SPEC, max_model_len=64, max_num_batched_tokens=8,
                 max_num_seqs=4, num_gpu_blocks_override=24, block_size=4)
    prompts = [p[:30] for p in PROMPTS] * 2
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, logprobs=1)
    got = generate(tight, prompts, params)
    want = generate(base, prompts, params)
    stats = tight.llm_engine.get_stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0 and stats["num_preemptions"] > 0
    for g, w, p in zip(got, want, prompts):
        n = 64 - len(p)  # the context ends first
        assert list(g.token_ids) == list(w.token_ids)[:n] and g.finish_reason == "length"
        assert len(g.logprobs) == n


def test_prefix_cache_hits_blocks_filled_by_drafted_steps(engines):
    """Blocks are hashed only over verified tokens: a later prompt running into a drafted
    request's prompt and output hits them, and gets the tokens it gets without speculation."""
    spec, base = engines
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    first = generate(spec, PROMPTS[:1], params)[0]
    longer = [list(PROMPTS[0]) + list(first.token_ids)[:36]]
    hits = spec.llm_engine.get_stats()["prefix_cache_hits"]
    short = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert [list(o.token_ids) for o in generate(spec, longer, short)] == \
        [list(o.token_ids) for o in generate(base, longer, short)]
    # the prompt's 30 tokens and the output's blocks: past the prompt's own
    assert spec.llm_engine.get_stats()["prefix_cache_hits"] - hits >= 48


def test_stop_string_inside_an_accepted_run_cuts_its_tokens(engines, kiln_logs):
    """A stop string completed by a token in the middle of a step's accepted drafts ends the
    output at that token: the tokens after it (and their logprobs) are no output, as they
    would never have been sampled without speculation (min_tokens moves the stop into runs
    of repeated tokens, which the drafts predict; "w33" also matches inside "w334")."""
    spec, base = engines
    cases = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0,
                            stop=[stop], min_tokens=m, include_stop_str_in_output=inc)
             for stop in ("w334", "w33") for m in range(1, 6) for inc in (False, True)]
    before = spec_totals(spec)["spec_decode_num_accepted_tokens"]
    generated = spec.llm_engine.get_stats()["generation_tokens_total"]
    got = generate(spec, PROMPTS[:1] * len(cases), cases)
    want = generate(base, PROMPTS[:1] * len(cases), cases)
    assert spec_totals(spec)["spec_decode_num_accepted_tokens"] > before
    # get_stats counts the tokens emitted, not those of the run the stop cut
    assert spec.llm_engine.get_stats()["generation_tokens_total"] - generated == \
        sum(len(g.token_ids) for g in got)
    for g, w, p in zip(got, want, cases):
        assert (list(g.token_ids), g.text, g.finish_reason, g.stop_reason) == \
            (list(w.token_ids), w.text, w.finish_reason, w.stop_reason), p
        assert len(g.logprobs) == len(w.logprobs)
        assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-4)
    # vLLM's SpecDecoding line follows the stats line; the engine without speculation has none
    spec.llm_engine.do_log_stats()
    base.llm_engine.do_log_stats()
    lines = [r.getMessage() for r in kiln_logs.records]
    assert sum(line.startswith("Avg prompt throughput") for line in lines) == 2
    (line,) = [line for line in lines if line.startswith("SpecDecoding metrics: ")]
    assert "Mean acceptance length: " in line and "Per-position acceptance rate: " in line


def test_repetition_inside_an_accepted_run_cuts_it_as_without_speculation(engines):
    """vLLM's repetition detection checks each accepted token as it is appended: an output
    whose repetition completes inside a step's accepted drafts ends at that token, with its
    logprobs, exactly as without speculation."""
    spec, base = engines
    for rd in ({"max_pattern_size": 4, "min_count": 2}, {"max_pattern_size": 1, "min_count": 3},
               {"max_pattern_size": 6, "min_pattern_size": 3, "min_count": 2}):
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1,
                                repetition_detection=rd)
        got, want = generate(spec, PROMPTS, params), generate(base, PROMPTS, params)
        assert [(list(o.token_ids), o.finish_reason, o.stop_reason) for o in got] == \
            [(list(o.token_ids), o.finish_reason, o.stop_reason) for o in want]
        assert [len(o.logprobs) for o in got] == [len(o.token_ids) for o in got]
        assert any(o.finish_reason == "repetition" for o in got)
