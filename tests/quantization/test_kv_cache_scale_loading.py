"""Which checkpoints' KV cache scales a model load reads, and what it says about them, as vLLM
does: a quantization config that asks for an fp8 cache and ships no k_scale / v_scale runs it at
1.0 with one warning naming how many layers and what fixes it."""
import pytest
import torch
from safetensors.torch import load_file

from kiln.engine.arg_utils import EngineArgs
from kiln.model.layers.attention import Attention
from kiln.model.layers.quantization import get_quant_config
from kiln.model.loader import build_model

from kv_cache_checkpoint import kv_only_config, with_quantization_config
from w8a8_checkpoint import write_w8a8_checkpoint

DEFAULT_SCALE = "use the default scale 1.0"


def load(model_dir, extra: dict | None = None, model_out: list | None = None, **engine_args):
    """The model of `model_dir` loaded with `extra` tensors beside the checkpoint's: its
    attention layers by name, and the parts load_weights reported (the model and its config
    appended to `model_out`)."""
    config = EngineArgs(model=str(model_dir), **engine_args).create_kiln_config()
    quant_config = get_quant_config(config.model_config)
    model = build_model(config)
    if quant_config is not None:  # W8A8's int8 parameters, as the loader makes them
        quant_config.prepare(model)
    tensors = {**load_file(str(model_dir / "model.safetensors")), **(extra or {})}
    with torch.no_grad():
        loaded = model.load_weights(iter(tensors.items()))
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Attention)}
    if model_out is not None:
        model_out += [model, config]
    return layers, loaded


def _scales(layers) -> list[tuple[float, float]]:
    return [(a.impl.k_scale, a.impl.v_scale) for _, a in sorted(layers.items())]


def test_a_kv_cache_scheme_without_scales_warns_once_naming_the_layers_and_the_fix(
        tiny_llama_dir, tmp_path, kiln_logs):
    model = with_quantization_config(tiny_llama_dir, tmp_path / "kv", kv_only_config())
    layers, _ = load(model)  # auto: the scheme's fp8
    assert _scales(layers) == [(1.0, 1.0)] * 2
    warnings = [r.getMessage() for r in kiln_logs.records if DEFAULT_SCALE in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "asks for an fp8 KV cache (kv_cache_scheme)" in warnings[0]
    assert "no k_scale / v_scale for 2 of its 2 attention layer(s)" in warnings[0]
    assert "llm-compressor" in warnings[0]


def test_the_warning_counts_only_the_layers_left_at_one(tiny_llama_dir, tmp_path, kiln_logs):
    model = with_quantization_config(tiny_llama_dir, tmp_path / "kv", kv_only_config())
    layers, _ = load(model, {"model.layers.1.self_attn.k_scale": torch.tensor(0.5),
                             "model.layers.1.self_attn.v_scale": torch.tensor(2.0)})
    assert _scales(layers) == [(1.0, 1.0), (0.5, 2.0)]
    assert "no k_scale / v_scale for 1 of its 2 attention layer(s)" in kiln_logs.text


def test_an_fp8_cache_of_a_w8a8_checkpoint_without_scales_warns_as_vllm_does(
        tiny_llama_dir, tmp_path, kiln_logs):
    """vLLM's compressed-tensors layers read KV scales with or without a kv_cache_scheme, and
    warn for an e4m3 cache left at 1.0; e5m2 and a model-dtype cache are not warned about."""
    model = write_w8a8_checkpoint(tiny_llama_dir, tmp_path / "w8a8")
    load(model, kv_cache_dtype="fp8")
    assert "--kv-cache-dtype fp8 runs an fp8 KV cache but the checkpoint has no k_scale / " \
           "v_scale for 2 of its 2" in kiln_logs.text
    kiln_logs.clear()
    load(model, kv_cache_dtype="fp8_e5m2")
    load(model)
    assert DEFAULT_SCALE not in kiln_logs.text


def test_a_checkpoint_with_every_scale_is_not_warned_about(tiny_llama_dir, tmp_path,
                                                           kiln_logs):
    model = with_quantization_config(tiny_llama_dir, tmp_path / "kv", kv_only_config())
    layers, _ = load(model, {f"model.layers.{i}.self_attn.kv_scale": torch.tensor(0.25)
                             for i in range(2)})
    assert _scales(layers) == [(0.25, 0.25)] * 2
    assert DEFAULT_SCALE not in kiln_logs.text


SCALES = {"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
          "model.layers.0.self_attn.v_scale": torch.tensor(2.0),
          "model.layers.1.self_attn.k_proj.output_scale": torch.tensor(0.25),
          "model.layers.1.self_attn.v_proj.output_scale": torch.tensor(4.0)}


def _gptq(tiny_llama_dir, tmp_path):
    from int4_checkpoint import write_int4_checkpoint

    return write_int4_checkpoint(tiny_llama_dir, tmp_path / "gptq", tmp_path / "oracle", "gptq",
                                 32)[0]


@pytest.mark.parametrize("checkpoint,args,method", [
    (lambda src, tmp: src, {}, "no quantization_config"),
    (_gptq, {}, "quantization 'gptq'"),
], ids=["float", "gptq"])
def test_scales_a_quantization_method_does_not_read_are_skipped_with_a_warning(
        tiny_llama_dir, tmp_path, kiln_logs, checkpoint, args, method):
    """vLLM's Attention layers hold k_scale / v_scale parameters only under a quantization
    config with a KV cache method (compressed-tensors, fp8); a float or GPTQ checkpoint's scale
    tensors find none and are skipped with a warning: its fp8 cache runs at 1.0 (they ran at
    the checkpoint's scales)."""
    layers, _ = load(checkpoint(tiny_llama_dir, tmp_path), SCALES, kv_cache_dtype="fp8", **args)
    assert _scales(layers) == [(1.0, 1.0)] * 2
    assert all(not a.checkpoint_scales for a in layers.values())
    assert "KV cache scale tensors (model.layers.0.self_attn.k_scale and 3 more), but with " \
           f"{method} they are not loaded" in kiln_logs.text
    assert "compressed-tensors quantization_config with a kv_cache_scheme" in kiln_logs.text
    assert DEFAULT_SCALE not in kiln_logs.text  # vLLM: no KV cache method, no 1.0 warning


@pytest.mark.parametrize("checkpoint,args", [
    (lambda src, tmp: with_quantization_config(src, tmp / "kv"), {}),
    (lambda src, tmp: write_w8a8_checkpoint(src, tmp / "w8a8"), {}),
    (lambda src, tmp: src, {"quantization": "fp8"}),
], ids=["kv-cache-scheme", "w8a8-without-scheme", "online-fp8"])
def test_scales_are_read_where_vllm_reads_them(tiny_llama_dir, tmp_path, kiln_logs,
                                               checkpoint, args):
    layers, _ = load(checkpoint(tiny_llama_dir, tmp_path), SCALES, kv_cache_dtype="fp8", **args)
    assert _scales(layers) == [(0.5, 2.0), (0.25, 4.0)]
    assert "not loaded" not in kiln_logs.text


def test_load_weights_reports_the_scales_it_loaded_as_vllm_names_them(tiny_llama_dir,
                                                                      tmp_path):
    """load_weights returns the parts it loaded; vLLM's holds each layer's `attn.k_scale` /
    `attn.v_scale` parameter, so a checkpoint shard or an update of scales alone reports them
    (it returned nothing for them, as if no tensor had been taken)."""
    from kiln.worker.weight_update import load_in_place

    built = []
    layers, loaded = load(with_quantization_config(tiny_llama_dir, tmp_path / "kv"), SCALES,
                          built)
    scale_parts = {"model.layers.0.self_attn.attn.k_scale",
                   "model.layers.0.self_attn.attn.v_scale",
                   "model.layers.1.self_attn.attn.k_scale",
                   "model.layers.1.self_attn.attn.v_scale"}
    assert scale_parts <= loaded
    model, config = built
    # an update of one layer's scales alone: those, a kv_scale as both; no weight counted
    update = {"model.layers.1.self_attn.kv_scale": torch.tensor(3.0)}
    got = load_in_place(model, update, config)
    assert got == {"model.layers.1.self_attn.attn.k_scale",
                   "model.layers.1.self_attn.attn.v_scale"}
    assert _scales(layers) == [(0.5, 2.0), (3.0, 3.0)]
    assert len(model.missing_weights(got)) == len(model.missing_weights(set()))
    # scales a float model does not read are not reported as loaded
    float_built = []
    load(tiny_llama_dir, None, float_built, kv_cache_dtype="fp8")
    assert load_in_place(float_built[0], update, float_built[1]) == set()
