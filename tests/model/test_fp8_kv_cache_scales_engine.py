"""An engine over a checkpoint with per-layer fp8 KV cache scales (a compressed-tensors W8A8
checkpoint with kv_cache_scheme, the k_scale / v_scale tensors under both names vLLM reads): the
scales reach every layer, the C kernels (eager and compiled) run as the torch backend does over
the same scaled cache, the cache holds x / scale (not what scales 1.0 store), "auto" runs a
kv_cache_scheme's in fp8 and ignores scales without one (as vLLM does), and bad scales or schemes
are refused naming the tensor or field."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.attention.kv_cache_dtype import from_cache
from kiln.entrypoints.llm import LLM
from kiln.errors import ConfigError
from kiln.sampling_params import SamplingParams

from w8a8_checkpoint import write_w8a8_checkpoint

PROMPTS = [{"prompt_token_ids": [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 3, 3, 7, 1, 2, 9, 8, 8, 4, 6, 11]},
           {"prompt_token_ids": [31, 32, 33, 34, 35, 36, 37, 38, 39]}]
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, logprobs=0, ignore_eos=True)
KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
             "symmetric": True}


def _scales(layer: int) -> tuple[float, float]:
    return 0.3 + 0.1 * layer, 2.5 + 0.5 * layer  # not powers of 2: every byte moves


def _with_scales(src, dst, names=("self_attn.k_scale", "self_attn.v_scale"), edit=None):
    """W8A8 copy of `src` with kv_cache_scheme and each layer's scales: layer 0's under vLLM's
    current names, the others' as k/v_proj.output_scale (llm-compressor's older ones)."""
    write_w8a8_checkpoint(src, dst, kv_cache_scheme=KV_SCHEME)
    tensors = load_file(str(dst / "model.safetensors"))
    layers = json.loads((dst / "config.json").read_text())["num_hidden_layers"]
    for i in range(layers):
        ks, vs = _scales(i)
        kname, vname = names if i == 0 else ("self_attn.k_proj.output_scale",
                                             "self_attn.v_proj.output_scale")
        tensors[f"model.layers.{i}.{kname}"] = torch.tensor(ks)
        tensors[f"model.layers.{i}.{vname}"] = torch.tensor(vs)
    if edit:
        edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _layers(worker) -> list:
    """collective_rpc's function: each layer's scales and a copy of its cache."""
    return [(name, layer.impl.k_scale, layer.impl.v_scale, layer.kv_cache.clone())
            for name, layer in sorted(worker.model_runner.attention_layers.items())]


def _run(model_dir, params=PARAMS, **kwargs):
    kwargs = {"enforce_eager": True, "kv_cache_dtype": "fp8", **kwargs}
    llm = LLM(model=str(model_dir), max_model_len=64, max_num_seqs=8, kv_cache_memory=0.001,
              **kwargs)
    try:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        layers = llm.collective_rpc(_layers)[0]
    finally:
        llm.shutdown()
    return ([o.outputs[0].token_ids for o in outs],
            [[next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs] for o in outs],
            layers)


@pytest.fixture(scope="module")
def scaled_dir(tiny_llama_dir, tmp_path_factory):
    return _with_scales(tiny_llama_dir, tmp_path_factory.mktemp("kv_scales"))


def test_checkpoint_scales_run_on_every_path_as_the_torch_backend(scaled_dir, tiny_llama_dir,
                                                                  tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "0")
    tokens, logprobs, layers = _run(scaled_dir)
    for i, (name, k_scale, v_scale, _) in enumerate(layers):
        assert (k_scale, v_scale) == pytest.approx(_scales(i)), name
    # compiled (mode 3): the scales are the layers' state, read by the opaque attention op
    compiled = _run(scaled_dir, enforce_eager=False,
                    compilation_config={"mode": 3, "backend": "eager"})
    assert compiled[0] == tokens
    assert max(abs(a - b) for x, y in zip(compiled[1], logprobs) for a, b in zip(x, y)) < 1e-4
    # the torch backend (the reference: x / scale stored, stored * scale read) with chunked
    # prefill: the C kernels' tokens, logprobs within float32 noise
    monkeypatch.setenv("KILN_ATTENTION_BACKEND", "torch")
    ref_tokens, ref_logprobs, ref_layers = _run(scaled_dir, max_num_batched_tokens=8)
    monkeypatch.delenv("KILN_ATTENTION_BACKEND")
    assert ref_tokens == tokens
    assert max(abs(a - b) for x, y in zip(ref_logprobs, logprobs) for a, b in zip(x, y)) < 1e-4
    # scales 1.0 (the same checkpoint without them) store other bytes, which read back to about
    # the same K/V: each cache holds x / its scale. The prompts' K/V only (one token sampled):
    # the two runs' greedy picks may part
    prefill = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)
    _, _, layers = _run(scaled_dir, prefill)
    plain = write_w8a8_checkpoint(tiny_llama_dir, tmp_path / "plain")
    _, _, plain_layers = _run(plain, prefill)
    for (name, k_scale, v_scale, cache), (_, _, _, plain_cache) in zip(layers, plain_layers):
        assert not torch.equal(cache.view(torch.uint8), plain_cache.view(torch.uint8)), name
        used = plain_cache[0].float().abs().amax(dim=(-1, -2)) > 0  # the slots written
        for half, scale in ((0, k_scale), (1, v_scale)):
            got = from_cache(cache[half][used], torch.float32, scale)
            want = plain_cache[half][used].float()
            # two e4m3 roundings (3 mantissa bits) of about the same values, layer 0's
            # differences carried into layer 1's: ~4% of the norm, measured (without the
            # scale on read, the error would be |1 / scale - 1| of it: over 50%)
            error = float((got - want).norm() / want.norm())
            print(name, "KV"[half], "relative error", error)
            assert error < 0.1, (name, half)


def test_auto_runs_a_kv_cache_scheme_in_fp8_and_leaves_plain_scales_unused(
        scaled_dir, tiny_llama_dir, tmp_path, monkeypatch):
    """vLLM's Attention layers make a compressed-tensors kv_cache_scheme's cache fp8 whatever
    --kv-cache-dtype says; scale tensors of a float checkpoint are not read (no KV cache method
    holds them), and its cache stays in the model dtype."""
    monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "0")
    _, _, layers = _run(scaled_dir, kv_cache_dtype="auto")
    for i, (name, k_scale, v_scale, cache) in enumerate(layers):
        assert (k_scale, v_scale) == pytest.approx(_scales(i)), name
        assert cache.dtype == torch.float8_e4m3fn
    plain = shutil.copytree(tiny_llama_dir, tmp_path / "plain")
    tensors = load_file(str(plain / "model.safetensors"))
    for i in range(len(layers)):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(_scales(i)[0])
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(_scales(i)[1])
    save_file(tensors, str(plain / "model.safetensors"), metadata={"format": "pt"})
    _, _, layers = _run(plain, kv_cache_dtype="auto")
    assert {(k, v) for _, k, v, _ in layers} == {(1.0, 1.0)}
    assert {cache.dtype for *_, cache in layers} == {torch.float32}


@pytest.mark.parametrize("bad", [float("nan"), 0.0])
def test_a_bad_scale_is_refused_naming_its_tensor(tiny_llama_dir, tmp_path, bad, monkeypatch):
    monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "0")

    def edit(tensors):
        tensors["model.layers.1.self_attn.v_proj.output_scale"] = torch.tensor(bad)

    model = _with_scales(tiny_llama_dir, tmp_path / "bad", edit=edit)
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.self_attn\.v_proj\.output_scale "
                                          r"is (nan|0\.0).*finite and > 0"):
        _run(model)


def test_a_dynamic_kv_cache_scheme_and_an_e5m2_cache_are_refused(scaled_dir, tmp_path,
                                                                 monkeypatch):
    from kiln.engine.arg_utils import EngineArgs

    monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "0")
    with pytest.raises(ConfigError, match="fp8_e5m2: the checkpoint's kv_cache_scheme"):
        EngineArgs(model=str(scaled_dir), kv_cache_dtype="fp8_e5m2").create_kiln_config()
    dynamic = shutil.copytree(scaled_dir, tmp_path / "dynamic")
    config = json.loads((dynamic / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"]["dynamic"] = True
    (dynamic / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"kv_cache_scheme\.dynamic=True is not supported"):
        _run(dynamic)
