"""LLM.beam_search on tiny random checkpoints: beam_width 1 is greedy, beam_width 2-4 equals HF
transformers' generate(num_beams=...) where the two agree (no eos: every hypothesis runs to
max_tokens, as vLLM's test_beam_search compares them), and an independent search over HF's full
distributions on an 8-token vocabulary checks eos, length_penalty and the ranking exactly."""
import itertools

import pytest
import torch

from kiln.beam_search import get_beam_search_score
from kiln.entrypoints.llm import LLM
from kiln.sampling_params import BeamSearchParams, SamplingParams

from checkpoints import hf_greedy, make_tiny_checkpoint, random_prompts

# The engine core in this process: what is tested is the engine, not its process (a core
# process costs an interpreter start per engine; test_core_process.py covers that one).
pytestmark = pytest.mark.usefixtures("inprocess_core")

ENGINE = dict(enforce_eager=True, max_model_len=64, max_num_seqs=8, kv_cache_memory=0.02)
EOS = 2


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def small_vocab_dir(tmp_path_factory):
    # 8 tokens (eos among them): eos is often a top candidate, and HF's full distribution over
    # every continuation is small enough to search exhaustively.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("vocab8"), "llama", tie=False,
                                vocab_size=8, seed=3)


@pytest.fixture(scope="module")
def small_llm(small_vocab_dir):
    llm = LLM(model=str(small_vocab_dir), **ENGINE)
    yield llm
    llm.shutdown()


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_beam_width_1_is_greedy(llm, tiny_llama_dir):
    prompts = random_prompts(3, [4, 7, 11], seed=1)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=1, max_tokens=10, ignore_eos=True))
    greedy = hf_greedy(tiny_llama_dir, prompts, 10)
    for p, out, want in zip(prompts, outs, greedy):
        (seq,) = out.sequences
        assert seq.tokens == p + want
        assert seq.finish_reason == "length"
        assert len(seq.logprobs) == 10 and all(len(step) == 2 for step in seq.logprobs)


@pytest.mark.parametrize("beam_width, length_penalty", [(2, 1.0), (3, 0.5), (4, 2.0)])
def test_matches_hf_beam_search(llm, tiny_llama_dir, beam_width, length_penalty):
    prompts = random_prompts(2, [5, 9], seed=beam_width)
    max_tokens = 8
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens,
                                            ignore_eos=True, length_penalty=length_penalty))
    model = hf_model(tiny_llama_dir)
    model.generation_config.eos_token_id = None  # as ignore_eos: all run to max_tokens
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            hf = model.generate(torch.tensor([p]), do_sample=False, num_beams=beam_width,
                                num_return_sequences=beam_width, max_new_tokens=max_tokens,
                                length_penalty=length_penalty, early_stopping=False,
                                output_scores=True, return_dict_in_generate=True,
                                pad_token_id=0)
        assert [s.tokens for s in out.sequences] == hf.sequences.tolist()
        # HF's score is the sum over the generated length ** length_penalty
        hf_sums = (hf.sequences_scores * max_tokens ** length_penalty).tolist()
        assert [s.cum_logprob for s in out.sequences] == pytest.approx(hf_sums, abs=1e-3)


def full_logprobs(model, tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, -1]
    return torch.log_softmax(logits.double(), -1).tolist()


def exhaustive(model, prompt, max_tokens, length_penalty, beam_width, ignore_eos=False):
    """Every continuation of up to max_tokens tokens (ending at eos or at max_tokens), scored
    with vLLM's formula: the best beam_width."""
    found = []
    frontier = [(list(prompt), 0.0)]
    for _ in range(max_tokens):
        nxt = []
        for tokens, cum in frontier:
            for t, lp in enumerate(full_logprobs(model, tokens)):
                seq = (tokens + [t], cum + lp)
                if t == EOS and not ignore_eos:
                    found.append(seq)
                else:
                    nxt.append(seq)
        frontier = nxt
    found += frontier
    eos = None if ignore_eos else EOS
    found.sort(key=lambda s: get_beam_search_score(s[0], s[1], EOS if eos else None,
                                                   length_penalty), reverse=True)
    return found[:beam_width]


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.5])
def test_wide_beam_equals_exhaustive_search(small_llm, small_vocab_dir, length_penalty):
    # beam_width = the vocabulary: after 1 step every token lives, so 2 steps of beam search
    # are every continuation (and 2 * beam_width logprobs asks for more than the vocabulary)
    model = hf_model(small_vocab_dir)
    prompts = random_prompts(3, [3, 5, 4], vocab=8, seed=7)
    outs = small_llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                                 BeamSearchParams(beam_width=8, max_tokens=2,
                                                  length_penalty=length_penalty))
    for p, out in zip(prompts, outs):
        want = exhaustive(model, p, 2, length_penalty, 8)
        assert [s.tokens for s in out.sequences] == [w[0] for w in want]
        assert [s.cum_logprob for s in out.sequences] == pytest.approx([w[1] for w in want],
                                                                        abs=1e-4)
        if length_penalty == 0.0:  # plain sums favour the short: an eos ending ranks
            assert any(s.tokens[-1] == EOS and s.finish_reason == "stop"
                       for s in out.sequences)


def reference_beam_search(model, prompt, beam_width, max_tokens, length_penalty):
    """vLLM's algorithm written plainly over HF's full distributions: each beam's top
    2 * beam_width tokens; eos finishes; the best beam_width others by sum live on."""
    live, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        cands = []
        for tokens, cum in live:
            lps = full_logprobs(model, tokens)
            top = sorted(range(len(lps)), key=lambda t: -lps[t])[:2 * beam_width]
            for t in top:
                (done if t == EOS else cands).append((tokens + [t], cum + lps[t]))
        live = sorted(cands, key=lambda c: -c[1])[:beam_width]
    return sorted(done + live, reverse=True,
                  key=lambda s: get_beam_search_score(s[0], s[1], EOS, length_penalty)
                  )[:beam_width]


@pytest.mark.parametrize("beam_width, length_penalty", list(itertools.product([2, 3], [0.5, 1.5])))
def test_matches_a_plain_reference_with_eos(small_llm, small_vocab_dir, beam_width,
                                            length_penalty):
    model = hf_model(small_vocab_dir)
    prompts = random_prompts(4, [3, 6], vocab=8, seed=11)
    outs = small_llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                                 BeamSearchParams(beam_width=beam_width, max_tokens=3,
                                                  length_penalty=length_penalty))
    for p, out in zip(prompts, outs):
        want = reference_beam_search(model, p, beam_width, 3, length_penalty)
        assert [s.tokens for s in out.sequences] == [w[0] for w in want]
        assert [s.cum_logprob for s in out.sequences] == pytest.approx([w[1] for w in want],
                                                                        abs=1e-4)


def test_text_prompts_concurrency_limit_and_engine_left_idle(llm):
    prompts = ["w5 w9 w11", "w100 w7", "w42"]
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    whole = llm.beam_search(prompts, params)
    limited = llm.beam_search(prompts, params, concurrency_limit=1)
    assert [[s.tokens for s in o.sequences] for o in whole] == \
        [[s.tokens for s in o.sequences] for o in limited]
    for prompt, o in zip(prompts, whole):
        assert len(o.sequences) == 2
        assert o.sequences[0].text.startswith(prompt)  # vLLM's: the prompt's text too
    stats = llm.llm_engine.get_stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    # and plain generation still works after it
    (g,) = llm.generate("w5", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(g.outputs[0].token_ids) == 3


def test_refusals_name_the_problem(llm):
    with pytest.raises(ValueError, match="beam_width=11"):
        llm.beam_search(["w5"], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="params must be a BeamSearchParams"):
        llm.beam_search(["w5"], SamplingParams())
    with pytest.raises(ValueError, match="prompt 1"):
        llm.beam_search(["w5", {"prompt_token_ids": [5] * 70}],
                        BeamSearchParams(beam_width=2, max_tokens=2))


def test_prompt_near_max_model_len_ends_by_length(llm):
    p = random_prompts(1, [62], seed=5)[0]  # room for 2 tokens of max_model_len 64
    (out,) = llm.beam_search([{"prompt_token_ids": p}],
                             BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True))
    assert len(out.sequences) == 3
    assert all(len(s.tokens) == 64 and s.finish_reason == "length" for s in out.sequences)


def test_offered_logprobs_carry_their_text(llm):
    # vLLM's steps detokenize: each offered token's Logprob has its text (it was None), the
    # text generate() gives the same token at the same place
    prompt = {"prompt_token_ids": [5, 6, 7]}
    (out,) = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=3,
                                                        ignore_eos=True))
    (sampled,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=4),
                              use_tqdm=False)
    want = {t: lp.decoded_token for t, lp in sampled.outputs[0].logprobs[0].items()}
    assert {t: lp.decoded_token for t, lp in out.sequences[0].logprobs[0].items()} == want
    assert all(lp.decoded_token for seq in out.sequences for step in seq.logprobs
               for lp in step.values())


# A beam that eos ended reports finish_reason "stop" with the eos id as stop_reason, as vLLM's
# beam search does (`stop_reason=tokenizer.eos_token_id`); Kiln's said null.
EOS_PROMPTS = random_prompts(4, [3, 6], vocab=8, seed=11)


def test_offline_beams_ended_by_eos_name_it(small_llm):
    outs = small_llm.beam_search([{"prompt_token_ids": p} for p in EOS_PROMPTS],
                                 BeamSearchParams(beam_width=3, max_tokens=3))
    seqs = [s for out in outs for s in out.sequences]
    assert any(s.finish_reason == "stop" for s in seqs)
    for s in seqs:
        assert s.stop_reason == (EOS if s.finish_reason == "stop" else None)
        assert (s.finish_reason == "stop") == (s.tokens[-1] == EOS)


def test_server_beams_ended_by_eos_name_it(small_llm):
    from fastapi.testclient import TestClient

    from kiln.engine.async_llm import AsyncLLM
    from kiln.entrypoints.openai.api_server import ServerSettings, build_app

    app = build_app(AsyncLLM(small_llm.llm_engine), ServerSettings(served_model_names=["m"]))
    with TestClient(app) as client:
        r = client.post("/v1/completions", json=dict(
            model="m", prompt=EOS_PROMPTS, use_beam_search=True, n=3, max_tokens=3,
            temperature=0, return_token_ids=True))
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert any(c["finish_reason"] == "stop" for c in choices)
    for c in choices:
        assert c["stop_reason"] == (EOS if c["finish_reason"] == "stop" else None)
