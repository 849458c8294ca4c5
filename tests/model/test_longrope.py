"""Phi-3's `longrope` rope scaling (the 128k configs) against HF transformers: the short factors
where max_model_len stays within original_max_position_embeddings, the long ones (and the
attention factor on cos / sin) past it, as vLLM chooses; logits and greedy tokens, eager and
compiled."""
import math

import pytest

from kiln import LLM, SamplingParams
from kiln.config.hf_config_snapshot import HFConfigSnapshot
from kiln.config.rope import get_rope_config
from kiln.errors import ConfigError
from kiln.model.layers.longrope import longrope_factors, longrope_mscale
from model.test_model_configs_vs_hf import TOL, make_checkpoint, max_logit_diff

from checkpoints import hf_greedy, random_prompts

ORIGINAL = 32  # original_max_position_embeddings; max_position_embeddings is 512
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.3 * i for i in range(8)],
            "long_factor": [2.0 + i for i in range(8)]}


@pytest.fixture(scope="module")
def longrope_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("phi3_longrope"), "Phi3Config",
                           sliding_window=None, pad_token_id=0, rope_scaling=LONGROPE,
                           original_max_position_embeddings=ORIGINAL)


def test_factors_and_attention_factor_as_hf_derives_them():
    config = HFConfigSnapshot({"rope_scaling": dict(LONGROPE), "max_position_embeddings": 512,
                               "original_max_position_embeddings": ORIGINAL})
    _, scaling = get_rope_config(config)
    assert scaling["factor"] == 16  # 512 / 32, which sets the attention factor
    assert longrope_mscale(scaling) == pytest.approx(math.sqrt(1 + math.log(16) / math.log(32)))
    assert longrope_mscale({**scaling, "attention_factor": 0.5}) == 0.5
    assert longrope_factors(scaling, 16, ORIGINAL) == LONGROPE["short_factor"]
    assert longrope_factors(scaling, 16, ORIGINAL + 1) == LONGROPE["long_factor"]
    with pytest.raises(ConfigError, match=r"long_factor has 8 values, but the rotary embedding "
                       r"has 4 frequencies \(head_dim 8"):
        longrope_factors(scaling, 8, 512)
    bad = HFConfigSnapshot({"rope_scaling": {**LONGROPE, "long_factor": [1.0, -2.0]},
                            "original_max_position_embeddings": ORIGINAL})
    with pytest.raises(ConfigError, match="rope_scaling long_factor must be a list of finite "
                       r"numbers > 0 .*\[1.0, -2.0\]"):
        get_rope_config(bad)


def test_logits_match_hf_short_and_long(longrope_dir):
    # HF: the short factors while a sequence is at most ORIGINAL long, the long ones past it
    assert max_logit_diff(longrope_dir, seq_len=30, max_model_len=ORIGINAL) < TOL
    assert max_logit_diff(longrope_dir, seq_len=45) < TOL


@pytest.mark.parametrize("mode", [0, 3])
def test_greedy_tokens_match_hf_eager_and_compiled(longrope_dir, mode, tmp_path):
    """An engine past the original length, prompts longer than it (long factors, the attention
    factor); eagerly also one whose sequences fit it (short factors: the same graph, another
    cos / sin cache, so compiled once only). Mode 3 on the eager backend (traced by Dynamo and
    split): the factors are chosen at build time, so the graph is Phi-3's, which is Llama's that
    Inductor compiles in tests/e2e/test_compile_parity.py."""
    kw = (dict(compilation_config={"mode": 3, "backend": "eager",
                                   "cache_dir": str(tmp_path / "cc")})
          if mode == 3 else dict(enforce_eager=True))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engines = ((None, [40, 70]),) if mode == 3 else ((None, [40, 70]), (ORIGINAL, [3, 20]))
    for max_model_len, lengths in engines:
        prompts = random_prompts(2, lengths, seed=11)
        llm = LLM(model=str(longrope_dir), dtype="float32", kv_cache_memory=0.05,
                  max_model_len=max_model_len, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy(longrope_dir, prompts, 8)
        del llm


def test_a_kv_cache_capping_max_model_len_within_the_original_length_runs_short_factors(
        longrope_dir):
    """max_model_len unset (the model's 512: long factors at build time), then a KV cache of
    ORIGINAL tokens caps it at ORIGINAL: every sequence fits the original length, so HF runs
    the short factors, and so must the engine (it ran the long ones, logprobs 0.3 off)."""
    prompts = random_prompts(1, [20], seed=11)
    llm = LLM(model=str(longrope_dir), dtype="float32", kv_cache_memory=0.05, block_size=16,
              num_gpu_blocks_override=ORIGINAL // 16, enforce_eager=True)
    assert llm.llm_engine.max_model_len == ORIGINAL
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(longrope_dir, prompts, 8)
