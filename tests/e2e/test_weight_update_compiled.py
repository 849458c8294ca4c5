"""Weights updated under Kiln's compiled graphs (mode 3, Inductor), with the engine core in its
own process: the graphs read the new weights (Inductor folded or packed no stale copy; the
oneDNN copies are packed again), as HF on the new checkpoint says, and a sleep and wake_up
between keeps them."""
from safetensors.torch import load_file

from kiln import LLM, SamplingParams

from checkpoints import hf_greedy, make_tiny_checkpoint, random_prompts

PROMPTS = random_prompts(2, [4, 21], seed=5)
NEW = 6


def _tokens(llm):
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_mode3_serves_updated_weights(tiny_llama_dir, tmp_path):
    other = make_tiny_checkpoint(tmp_path / "other", "llama", tie=False, seed=2)
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", enable_sleep_mode=True,
              max_model_len=64, max_num_batched_tokens=32, max_num_seqs=8, kv_cache_memory=0.01,
              compilation_config={"mode": 3, "cache_dir": str(tmp_path / "cc")})
    try:
        assert _tokens(llm) == hf_greedy(tiny_llama_dir, PROMPTS, NEW)
        weights = list(load_file(str(other / "model.safetensors")).items())
        llm.collective_rpc("load_weights", kwargs={"weights": weights})  # pickled to the core
        expected = hf_greedy(other, PROMPTS, NEW)
        assert _tokens(llm) == expected
        llm.sleep(level=1)
        llm.wake_up()
        assert _tokens(llm) == expected
    finally:
        llm.shutdown()
