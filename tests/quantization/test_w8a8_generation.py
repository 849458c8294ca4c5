"""W8A8 int8 engines generate the same greedy tokens eagerly (mode 0) and compiled (mode 3): a
compressed-tensors checkpoint and online `quantization="int8"`, mixed lengths with chunked
prefill. Their logprobs differ from the float model's (the int8 path runs) but stay close.
"""
import pytest

from kiln import LLM, SamplingParams

from checkpoints import make_tiny_checkpoint, random_prompts
from w8a8_checkpoint import write_w8a8_checkpoint

LENGTHS = [1, 9, 40, 90]  # 90 > the 64-token budget: chunked prefill
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    src = make_tiny_checkpoint(tmp_path_factory.mktemp("float"), "llama", tie=False)
    return src, write_w8a8_checkpoint(src, tmp_path_factory.mktemp("w8a8"))


def _run(model_dir, tmp_path, mode, **kw):
    llm = LLM(model=str(model_dir), dtype="float32", max_num_batched_tokens=64, max_num_seqs=8,
              kv_cache_memory=0.05,
              compilation_config={"mode": mode, "cache_dir": str(tmp_path / "cc")}, **kw)
    prompts = random_prompts(len(LENGTHS), LENGTHS, seed=5)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[next(iter(step.values())).logprob for step in o.outputs[0].logprobs]
                for o in outs]
    return tokens, logprobs


def _max_diff(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.mark.parametrize("which", ["compressed-tensors", "online"])
def test_modes_0_and_3_give_identical_greedy_tokens(dirs, tmp_path, which):
    src, w8a8 = dirs
    model, kw = (w8a8, {}) if which == "compressed-tensors" else (src, {"quantization": "int8"})
    eager_tokens, eager_lp = _run(model, tmp_path, 0, **kw)
    compiled_tokens, compiled_lp = _run(model, tmp_path, 3, **kw)
    assert compiled_tokens == eager_tokens
    assert _max_diff(compiled_lp, eager_lp) < 1e-3
    float_tokens, float_lp = _run(src, tmp_path, 0)
    assert 0 < _max_diff(eager_lp, float_lp) < 0.2  # quantized, and close to the float model
