"""Prompt logprobs against HF transformers' log-softmax (float32, within 1e-4): every prompt
token's logprob and rank and the top-N, through chunked prefill, preemption, n > 1, prefix
caching (skipped for these requests) and a compiled model."""
import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.sampling_params import RequestOutputKind

from checkpoints import random_prompts

# The engine core in this process: what is tested is the engine, not its process (a core
# process costs an interpreter start per engine; test_core_process.py covers that one).
pytestmark = pytest.mark.usefixtures("inprocess_core")

TOL = 1e-4


def _hf_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)


def _check(prompt, prompt_logprobs, ref, k):
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for pos, entry in enumerate(prompt_logprobs[1:], start=1):
        row, token = ref[pos - 1], prompt[pos]  # position pos - 1 predicts token pos
        assert token in entry and abs(entry[token].logprob - row[token].item()) < TOL
        # Kiln ranks its own logprobs, which equal HF's within TOL: a token HF puts just
        # below (or above) this one may come out on the other side of it.
        above_surely = int((row > row[token] + TOL).sum())
        above_maybe = int((row > row[token] - TOL).sum()) - 1  # less the token itself
        assert above_surely + 1 <= entry[token].rank <= above_maybe + 1
        top = torch.topk(row, k)
        others = {t: lp for t, lp in entry.items() if t != token}
        assert set(top.indices.tolist()) - {token} <= set(others) and len(entry) <= k + 1
        for t, lp in entry.items():
            assert abs(lp.logprob - row[t].item()) < TOL and lp.decoded_token is not None


def test_prompt_logprobs_match_hf_through_chunks_preemption_and_n(tiny_llama_dir):
    prompts = random_prompts(4, [1, 40, 130, 75], seed=7)
    # 48-token budget: the 130-token prompt takes three chunks; 16 blocks preempt the batch.
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", enforce_eager=True,
              max_num_batched_tokens=48, max_num_seqs=4, num_gpu_blocks_override=16)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        _check(prompt, out.prompt_logprobs, _hf_logprobs(tiny_llama_dir, prompt), 3)
    assert llm.llm_engine.get_stats()["num_preemptions"] > 0
    # n > 1 and a prefix the cache holds: still every prompt position, computed once.
    shared = prompts[2]
    llm.generate({"prompt_token_ids": shared}, SamplingParams(max_tokens=1), use_tqdm=False)
    (out,) = llm.generate({"prompt_token_ids": shared},
                          SamplingParams(n=2, temperature=1.0, max_tokens=4, prompt_logprobs=0),
                          use_tqdm=False)
    assert len(out.outputs) == 2 and out.num_cached_tokens == 0
    _check(shared, out.prompt_logprobs, _hf_logprobs(tiny_llama_dir, shared), 0)
    plain = llm.generate({"prompt_token_ids": shared}, SamplingParams(max_tokens=1),
                         use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0


def test_prompt_logprobs_compiled_and_streamed_once(tiny_qwen2_dir):
    prompt = random_prompts(1, [50], seed=8)[0]
    llm = LLM(model=str(tiny_qwen2_dir), dtype="float32", kv_cache_memory=0.05,
              compilation_config={"mode": 3, "backend": "eager"})
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=2,
                            output_kind=RequestOutputKind.DELTA)
    engine.add_request("r", {"prompt_token_ids": prompt}, params)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    carrying = [d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None]
    assert len(carrying) == 1 and deltas[0].prompt_logprobs is carrying[0]
    _check(prompt, carrying[0], _hf_logprobs(tiny_qwen2_dir, prompt), 2)


def test_prompt_logprobs_validated(tiny_llama_dir):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-2)
    # the cap is the engine's: vLLM's --max-logprobs, 20 by default, -1 the vocabulary
    llm = LLM(model=str(tiny_llama_dir), enforce_eager=True, max_model_len=64,
              kv_cache_memory=0.01)
    prompt = {"prompt_token_ids": [1, 2, 3]}
    for name in ("prompt_logprobs", "logprobs"):
        with pytest.raises(ValueError, match=f"{name} must be <= 20.*--max-logprobs"):
            llm.generate(prompt, SamplingParams(max_tokens=1, **{name: 21}), use_tqdm=False)
        # -1, vLLM's whole vocabulary, is within the cap only where the engine allows that
        with pytest.raises(ValueError, match=f"{name} is -1, the whole vocabulary.*"
                                             "--max-logprobs -1"):
            llm.generate(prompt, SamplingParams(max_tokens=1, **{name: -1}), use_tqdm=False)
    llm.shutdown()
    llm = LLM(model=str(tiny_llama_dir), enforce_eager=True, max_model_len=64,
              kv_cache_memory=0.01, max_logprobs=-1)
    vocab = llm.llm_engine.kiln_config.model_config.vocab_size
    out = llm.generate(prompt, SamplingParams(max_tokens=1, logprobs=30, prompt_logprobs=vocab),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) >= 30 and len(out.prompt_logprobs[1]) >= vocab
    out = llm.generate(prompt, SamplingParams(max_tokens=1, logprobs=-1, prompt_logprobs=-1),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) == vocab and len(out.prompt_logprobs[1]) == vocab
    llm.shutdown()
    with pytest.raises(ValueError, match="max_logprobs must be"):
        LLM(model=str(tiny_llama_dir), enforce_eager=True, max_logprobs=-2)
