"""A compressed-tensors checkpoint that quantizes only its KV cache (a kv_cache_scheme, no
config_groups, weights in the model dtype: what llm-compressor writes for KV cache quantization
alone) is served as vLLM serves it: unquantized linears and, with no --kv-cache-dtype, an fp8 KV
cache running the checkpoint's per-layer scales."""
import pytest
import torch
from safetensors.torch import load_file

from kiln.entrypoints.llm import LLM
from kiln.errors import ConfigError
from kiln.sampling_params import SamplingParams

from kv_cache_checkpoint import kv_only_config, with_kv_scales, with_quantization_config

PROMPTS = [{"prompt_token_ids": [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 3, 3, 7, 1, 2, 9, 8, 8, 4, 6, 11]},
           {"prompt_token_ids": [31, 32, 33, 34, 35, 36, 37, 38, 39]}]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)
KV_SCHEME = kv_only_config()["kv_cache_scheme"]


def kv_only_checkpoint(src, dst, scales=lambda layer: (0.3 + 0.1 * layer, 2.5 + 0.5 * layer),
                       scheme=KV_SCHEME):
    """`src` (a float checkpoint) with llm-compressor's KV-cache-only quantization_config and
    each layer's self_attn.k_scale / v_scale."""
    return with_kv_scales(with_quantization_config(src, dst, kv_only_config(
        kv_cache_scheme=scheme)), scales)


def _layers(worker) -> list:
    return [(name, layer.impl.k_scale, layer.impl.v_scale, layer.kv_cache.dtype)
            for name, layer in sorted(worker.model_runner.attention_layers.items())]


def _run(model_dir, **kwargs):
    llm = LLM(model=str(model_dir), max_model_len=64, max_num_seqs=8, kv_cache_memory=0.001,
              enforce_eager=True, **kwargs)
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        layers = llm.collective_rpc(_layers)[0]
        quantized = llm.llm_engine.model_config.quant_kind
    finally:
        llm.shutdown()
    return ([o.outputs[0].token_ids for o in outs],
            [[next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs] for o in outs],
            layers, quantized)


def test_scales_of_one_run_as_the_float_checkpoint_with_an_fp8_cache(tiny_llama_dir, tmp_path,
                                                                      monkeypatch):
    """The same float weights (the linears unquantized), and no --kv-cache-dtype giving the
    fp8 cache --kv-cache-dtype fp8 gives the float checkpoint: equal tokens and logprobs."""
    monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "0")
    model = kv_only_checkpoint(tiny_llama_dir, tmp_path / "kv", scales=lambda layer: (1.0, 1.0))
    tokens, logprobs, layers, quantized = _run(model)
    assert quantized is None
    assert {dtype for *_, dtype in layers} == {torch.float8_e4m3fn}
    want_tokens, want_logprobs, _, _ = _run(tiny_llama_dir, kv_cache_dtype="fp8")
    assert tokens == want_tokens
    assert logprobs == want_logprobs


def test_the_checkpoint_scales_run_by_default_as_the_torch_backend(tiny_llama_dir, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "0")
    model = kv_only_checkpoint(tiny_llama_dir, tmp_path / "kv")
    tokens, logprobs, layers, _ = _run(model)
    for i, (name, k_scale, v_scale, dtype) in enumerate(layers):
        assert (k_scale, v_scale) == pytest.approx((0.3 + 0.1 * i, 2.5 + 0.5 * i)), name
        assert dtype == torch.float8_e4m3fn
    monkeypatch.setenv("KILN_ATTENTION_BACKEND", "torch")
    ref_tokens, ref_logprobs, _, _ = _run(model)
    assert ref_tokens == tokens
    assert max(abs(a - b) for x, y in zip(ref_logprobs, logprobs) for a, b in zip(x, y)) < 1e-4


def test_a_per_head_scheme_is_refused_naming_its_strategy(tiny_llama_dir, tmp_path,
                                                          monkeypatch):
    monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "0")
    model = kv_only_checkpoint(tiny_llama_dir, tmp_path / "kv",
                               scheme={**KV_SCHEME, "strategy": "attn_head"})
    with pytest.raises(ConfigError, match=r"kv_cache_scheme\.strategy='attn_head' is not "
                                          r"supported \(per-head K/V scales need .*one per layer"):
        _run(model)


def test_its_float_weights_update_in_place_where_quantized_linears_are_refused(
        tiny_llama_dir, tmp_path, monkeypatch):
    """load_weights (vLLM's RL hook) goes by the linears' format: float ones update, as any
    float model's; int8 ones are refused naming it (it named a KV-cache-only checkpoint
    quantized before)."""
    from types import SimpleNamespace

    from kiln.worker.weight_update import update_refusal

    monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "0")
    w8a8 = SimpleNamespace(quant_kind="int8", quantization="compressed-tensors")
    assert "(quantization='compressed-tensors'): its layers hold int8 weights" in \
        update_refusal(torch.nn.Linear(2, 2), w8a8)
    llm = LLM(model=str(kv_only_checkpoint(tiny_llama_dir, tmp_path / "kv")), max_model_len=64,
              max_num_seqs=8, kv_cache_memory=0.001, enforce_eager=True)
    try:
        before = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        norm = load_file(str(tiny_llama_dir / "model.safetensors"))["model.norm.weight"]
        llm.collective_rpc("load_weights", kwargs={"weights": [("model.norm.weight", -norm)]})
        after = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in before] != [o.outputs[0].token_ids for o in after]


def test_a_draft_quantizing_its_kv_cache_follows_the_targets_cache_dtype(tiny_llama_dir,
                                                                          tmp_path):
    """The draft writes into caches sized in the target's dtype: a float target's engine keeps
    "auto" for a KV-cache-only draft (its layers read fp8 from a float cache before), and a
    KV-cache-only target's fp8 reaches a float draft."""
    from kiln.engine.arg_utils import EngineArgs
    from kiln.spec_decode.draft_model_proposer import draft_kiln_config

    kv = kv_only_checkpoint(tiny_llama_dir, tmp_path / "kv")
    for target, draft, want in ((tiny_llama_dir, kv, "auto"), (kv, tiny_llama_dir, "fp8")):
        config = EngineArgs(model=str(target), max_model_len=64, speculative_config={
            "model": str(draft), "num_speculative_tokens": 2}).create_kiln_config()
        assert config.cache_config.cache_dtype == want
        assert draft_kiln_config(config).cache_config.cache_dtype == want, (target, draft)


def test_an_mla_checkpoint_quantizing_its_kv_cache_runs_its_latent_cache_in_the_model_dtype(
        tiny_deepseek_v2_dir, tmp_path, monkeypatch, kiln_logs):
    """DeepSeek's latent cache has no fp8 form, and no flag undoes auto's fp8: auto keeps the
    model dtype (warned), serving the float checkpoint's tokens; it was refused as a quantized
    DeepSeek, telling to drop a --quantization never given. --kv-cache-dtype fp8 is refused."""
    monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "0")
    model = kv_only_checkpoint(tiny_deepseek_v2_dir, tmp_path / "kv")
    tokens, logprobs, layers, quantized = _run(model)
    assert quantized is None
    assert {(k, v, dtype) for _, k, v, dtype in layers} == {(1.0, 1.0, torch.float32)}
    assert "MLA latent cache has no fp8 form in Kiln: it runs in the model dtype" in kiln_logs.text
    assert (tokens, logprobs) == _run(tiny_deepseek_v2_dir)[:2]
    with pytest.raises(ConfigError, match="--kv-cache-dtype fp8: an fp8 KV cache for "
                                          "DeepseekV2ForCausalLM's MLA latent cache"):
        _run(model, kv_cache_dtype="fp8")
