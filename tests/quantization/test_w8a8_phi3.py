"""A compressed-tensors W8A8 int8 Phi-3 checkpoint: its fused qkv_proj / gate_up_proj int8 rows
and per-row scales split into the merged layers' shards as stored, an `ignore` naming a fused
module (its checkpoint name) leaves it float, and eager (mode 0) and compiled (mode 3) engines
give the same greedy tokens, close to the float model's."""
import pytest
import torch
from model._attn_helper import kiln_config_for
from safetensors.torch import load_file

from kiln.model.layers.quantization.w8a8_int8 import int8_weight
from kiln.model.loader import get_model
from quantization.test_w8a8_generation import _max_diff, _run

from checkpoints import make_tiny_checkpoint
from w8a8_checkpoint import write_w8a8_checkpoint


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    src = make_tiny_checkpoint(tmp_path_factory.mktemp("phi3"), "phi3", tie=False)
    return src, write_w8a8_checkpoint(src, tmp_path_factory.mktemp("phi3_w8a8"))


def test_fused_int8_weights_and_scales_load_as_stored(dirs):
    _, w8a8 = dirs
    model = get_model(kiln_config_for(w8a8))
    stored = load_file(str(w8a8 / "model.safetensors"))
    for layer in model.model.layers:
        for module in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.self_attn.o_proj,
                       layer.mlp.down_proj):
            name = next(n for n, m in model.named_modules() if m is module)
            assert torch.equal(int8_weight(module), stored[name + ".weight"]), name
            assert torch.equal(module.weight_scale, stored[name + ".weight_scale"].reshape(-1))
    assert model.lm_head.weight.dtype == torch.float32


def test_ignore_naming_the_fused_module_leaves_it_float(dirs, tmp_path):
    """Phi-3's ignore lists name qkv_proj / gate_up_proj, the modules its checkpoint has (they
    were matched against q_proj / k_proj / v_proj names, which a Phi-3 checkpoint lacks: the
    float tensors met int8 parameters)."""
    src, _ = dirs
    d = write_w8a8_checkpoint(src, tmp_path / "q", keep_float=r"model\.layers\.0\..*qkv_proj",
                              ignore=["lm_head", "model.layers.0.self_attn.qkv_proj"])
    layers = get_model(kiln_config_for(d)).model.layers
    assert layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    assert int8_weight(layers[1].self_attn.qkv_proj).dtype == torch.int8
    assert int8_weight(layers[0].mlp.gate_up_proj).dtype == torch.int8


@pytest.mark.usefixtures("inprocess_core")
def test_modes_0_and_3_give_identical_greedy_tokens(dirs, tmp_path):
    src, w8a8 = dirs
    eager_tokens, eager_lp = _run(w8a8, tmp_path, 0)
    # the eager backend: Phi-3's int8 graph is Llama's once its fused rows are split at load,
    # and test_w8a8_generation compiles that with Inductor and its fusion passes
    compiled_tokens, compiled_lp = _run(w8a8, tmp_path, 3, backend="eager")
    assert compiled_tokens == eager_tokens
    assert _max_diff(compiled_lp, eager_lp) < 1e-3
    float_tokens, float_lp = _run(src, tmp_path, 0)
    # quantized, and close to the float model while the tokens agree (a near tie may part them)
    agreed = [(a[:_common(ta, tb)], b[:_common(ta, tb)])
              for a, b, ta, tb in zip(eager_lp, float_lp, eager_tokens, float_tokens)]
    assert 0 < _max_diff(*zip(*agreed)) < 0.2


def _common(a: list[int], b: list[int]) -> int:
    """The length of the common prefix of two token lists."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
