"""Sliding-window models against HF transformers' eager attention (float32) on sequences longer
than the window: Mistral (a window of 8 in every layer), Gemma-2 (window-8 and global layers
alternating, attention and final logits soft-capped) and Gemma-3 (Gemma-2's layout, q/k norms,
a rope base per kind of layer), prompts of 20-40 tokens, chunked prefill
under a small token budget beside decodes, blocks of 4 (the window spans several): greedy tokens
equal, logprobs within LOGPROB_TOL. --disable-sliding-window still caps max_model_len."""
import pytest
import torch

from kiln import LLM, SamplingParams

from checkpoints import hf_greedy, random_prompts

# The engine core in this process: what is tested is the engine, not its process (a core
# process costs an interpreter start per engine; test_core_process.py covers that one).
pytestmark = pytest.mark.usefixtures("inprocess_core")

LOGPROB_TOL = 1e-4  # float32: measured worst 3e-6 on these models
NEW_TOKENS = 12


def _run(model_dir, **engine):
    prompts = random_prompts(3, [20, 33, 40], seed=11)
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory=0.05, block_size=4,
              max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4, **engine)
    assert llm.llm_engine.model_config.max_model_len == 128  # not capped at the window (8)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(
        model_dir, prompts, NEW_TOKENS, attn_implementation="eager")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0]
        with torch.no_grad():  # HF eager's log_softmax over the whole sequence [S, V]
            ref = torch.log_softmax(hf(torch.tensor([prompt + list(completion.token_ids)]))
                                    .logits[0].float(), dim=-1)
        for step, entry in enumerate(completion.logprobs):
            row = ref[len(prompt) - 1 + step]
            for token, lp in entry.items():
                assert abs(lp.logprob - row[token].item()) < LOGPROB_TOL, (step, token)


def test_mistral_window_matches_hf_eager_past_the_window(tiny_mistral_window_dir):
    _run(tiny_mistral_window_dir, enforce_eager=True)


def test_gemma2_compiled_matches_hf_eager(tiny_gemma2_dir, tmp_path):
    """Compiled by Inductor piecewise (mode 3): the soft cap and window inside the attention op
    (eager Gemma-2 is checked per backend in tests/model/test_attention_window.py)."""
    _run(tiny_gemma2_dir, compilation_config={"mode": 3, "cache_dir": str(tmp_path / "cc")})


def test_gemma3_matches_hf_eager_past_the_window(tiny_gemma3_dir):
    """Gemma-3: sliding and global layers roped with their own bases (local 100, global 10000
    linearly scaled), per-head (1 + w) q/k norms, no soft caps."""
    _run(tiny_gemma3_dir, enforce_eager=True)


def test_gemma3_compiled_matches_hf_eager(tiny_gemma3_dir, tmp_path):
    """Mode 3: the q/k norms and both rotary caches inside the compiled pieces."""
    _run(tiny_gemma3_dir, compilation_config={"mode": 3, "cache_dir": str(tmp_path / "cc")})


def test_disable_sliding_window_caps_max_model_len(tiny_mistral_window_dir):
    """vLLM's flag: full attention everywhere, so the context is capped at the window."""
    from kiln.config import ModelConfig

    capped = ModelConfig(model=str(tiny_mistral_window_dir), disable_sliding_window=True)
    assert capped.max_model_len == 8 and capped.get_sliding_window() is None
    assert capped.layer_sliding_window(0) is None
    with pytest.raises(ValueError, match=r"max_model_len=9 exceeds the model's sliding_window=8 "
                       r"\(under --disable-sliding-window.*--max-model-len to 8"):
        ModelConfig(model=str(tiny_mistral_window_dir), disable_sliding_window=True,
                    max_model_len=9)
    windowed = ModelConfig(model=str(tiny_mistral_window_dir))
    assert windowed.max_model_len == 512 and windowed.get_sliding_window() == 8
    assert [windowed.layer_sliding_window(i) for i in range(2)] == [8, 8]
