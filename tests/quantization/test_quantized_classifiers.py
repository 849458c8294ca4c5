"""A classifier's score head under quantization. Online int8 / fp8 keep it float32, as the LM
head stays in the model dtype; so do GPTQ / AWQ checkpoints, whose tools quantize the decoder
layers only. A compressed-tensors checkpoint's targets / ignore decide for a head it stores. A
head built from the LM head's rows (Qwen3-Reranker's classifier_from_token) is float like that
head.
"""
import pytest
import torch
from int4_checkpoint import write_int4_checkpoint
from model._attn_helper import kiln_config_for
from pooling.test_token_classifier import OVERRIDES, _reranker
from safetensors.torch import load_file, save_file

from kiln.model.layers.linear import LinearBase
from kiln.model.loader import get_model

from w8a8_checkpoint import quantize_rows, write_w8a8_checkpoint


def _assert_float_head_over_quantized_layers(model):
    assert model.score.weight.dtype == torch.float32 and model.score.quant_method is None
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down, LinearBase) and down.quant_method is not None


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_online_quantization_leaves_the_score_head_float32(tiny_cls_qwen3_dir, method):
    """It was quantized like a decoder linear: int8 rounding of the logits the probabilities
    come from, in the head seq_cls.py keeps float32 even in a bfloat16 model."""
    model = get_model(kiln_config_for(tiny_cls_qwen3_dir, quantization=method,
                                      quantization_rotation="none"))
    _assert_float_head_over_quantized_layers(model)


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_a_4bit_classifier_checkpoint_loads_its_float_score_head(tiny_cls_qwen3_dir, tmp_path,
                                                                 fmt):
    """AutoGPTQ / AutoAWQ leave the head float: it was made a 4-bit layer and the checkpoint's
    score.weight 'matched no parameter'."""
    q, _ = write_int4_checkpoint(tiny_cls_qwen3_dir, tmp_path / "q", tmp_path / "oracle", fmt, 32)
    model = get_model(kiln_config_for(q))
    _assert_float_head_over_quantized_layers(model)
    stored = load_file(str(q / "model.safetensors"))["score.weight"]
    assert torch.equal(model.score.weight, stored)


def test_a_w8a8_classifier_checkpoint_that_quantized_its_head_loads_it_int8(tiny_cls_qwen3_dir,
                                                                            tmp_path):
    """llm-compressor's default ignore list names lm_head only: a classifier's score is a Linear
    it targets, stored int8 with its scale."""
    d = write_w8a8_checkpoint(tiny_cls_qwen3_dir, tmp_path / "q")
    state = load_file(str(d / "model.safetensors"))
    state["score.weight"], state["score.weight_scale"] = quantize_rows(state["score.weight"])
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    model = get_model(kiln_config_for(d))
    assert model.score.weight.dtype == torch.int8 and model.score.quant_method is not None


def _quantized(src, dst, fmt):
    if fmt == "w8a8":
        return write_w8a8_checkpoint(src, dst)
    return write_int4_checkpoint(src, dst, dst.with_name(dst.name + "-oracle"), fmt, 32)[0]


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("fmt", ["w8a8", "compressed-tensors", "gptq", "awq"])
def test_a_quantized_rerankers_head_from_lm_head_rows_is_the_float_models(tmp_path, fmt, tie):
    """vLLM's Qwen3-Reranker overrides over a quantized checkpoint: the score head is built from
    the float LM head's (tied: the embedding's) rows. It was made a quantized layer, and loading
    failed: 'score.weight: checkpoint dtype torch.float32 where torch.int8 is expected'
    (compressed-tensors), 'matches no parameter' (4-bit)."""
    src = _reranker(tmp_path / "float", tie=tie, seed=4)
    model = get_model(kiln_config_for(_quantized(src, tmp_path / "q", fmt),
                                      hf_overrides=OVERRIDES))
    _assert_float_head_over_quantized_layers(model)
    float_model = get_model(kiln_config_for(src, hf_overrides=OVERRIDES))
    assert torch.equal(model.score.weight, float_model.score.weight)
