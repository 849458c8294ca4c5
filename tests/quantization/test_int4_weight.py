"""W4A16: 4-bit weight-only checkpoints (compressed-tensors pack-quantized, GPTQ, AWQ GEMM), written
here as each tool packs them, generate HF transformers' greedy tokens on the dequantized float
weights, logprobs within LOGPROB_TOL (float32 both sides; the native int4 kernel sums in float32
in its own order). The layouts convert exactly (unit tests) and stay 4-bit in memory;
unsupported schemes are refused naming the field and value.
"""
import json

import pytest
import torch
from int4_checkpoint import quantization_config, write_int4_checkpoint
from model._attn_helper import kiln_config_for

from kiln import LLM, SamplingParams
from kiln.errors import ConfigError
from kiln.ir import int4
from kiln.model.layers.linear import LinearBase
from kiln.model.loader import get_model
from kiln.native import int4_linear

from checkpoints import make_tiny_checkpoint, random_prompts

LENGTHS = [3, 17, 40]
NEW_TOKENS = 6
LOGPROB_TOL = 2e-4

pytestmark = pytest.mark.usefixtures("inprocess_core")


def test_canonical_layout_matches_compressed_tensors():
    from compressed_tensors.compressors.pack_quantized.helpers import (
        pack_to_int32,
        unpack_from_int32,
    )

    torch.manual_seed(0)
    q = torch.randint(-8, 8, (40, 64), dtype=torch.int8)
    packed = pack_to_int32(q, 4)
    assert torch.equal(int4.pack_int4(q.int() + 8), packed)
    assert torch.equal(int4.unpack_int4(packed) - 8, unpack_from_int32(packed, 4, q.shape).int())
    for group, zeros in ((32, None), (64, torch.randint(0, 17, (40, 1), dtype=torch.uint8))):
        scales = torch.rand(40, 64 // group).to(torch.bfloat16).float()
        want = int4.dequantize_int4(packed, scales, zeros, group)
        assert torch.equal(want, (unpack_from_int32(packed, 4, q.shape).float() + 8
                                  - (8 if zeros is None else zeros.float()))
                           * scales.repeat_interleave(group, 1))
        x = torch.randn(3, 64)
        assert torch.allclose(int4.int4_weight_linear(x, packed, scales, zeros, group),
                              x @ want.t(), atol=1e-4)  # float32 sums near 30


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("float"), "llama", tie=False)


@pytest.fixture(scope="module")
def src_one_layer(tmp_path_factory):
    """For the compiled run: one layer, fewer pieces to compile."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("float1"), "llama", tie=False,
                                num_hidden_layers=1)


def _hf(oracle, prompts, n):
    """HF's greedy tokens and their logprobs, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(oracle, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    tokens, logprobs = [], []
    with torch.no_grad():
        for ids in prompts:
            y = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                               pad_token_id=0)[0]
            lp = torch.log_softmax(model(y[None]).logits[0, len(ids) - 1:-1].float(), -1)
            new = y[len(ids):]
            tokens.append(new.tolist())
            logprobs.append(lp.gather(1, new[:, None])[:, 0].tolist())
    return tokens, logprobs


# End to end, one engine each: GPTQ in groups of 16 (the native kernel's dequantized tiles at
# every row count) eagerly; compressed-tensors in groups of 32 (its in-register GEMV for decode
# steps) compiled, on one layer (fewer pieces to compile). The formats'
# loaders are checked exactly below.
CASES = [("gptq", 16, True, 0, "src"), ("compressed-tensors", 32, False, 3, "src_one_layer")]


@pytest.mark.parametrize("fmt, group, symmetric, mode, source", CASES,
                         ids=["gptq-g16-sym-mode0", "ct-g32-asym-mode3"])
def test_generates_hf_tokens_on_the_dequantized_weights(request, tmp_path, fmt, group, symmetric,
                                                        mode, source):
    src = request.getfixturevalue(source)
    q, oracle = write_int4_checkpoint(src, tmp_path / "q", tmp_path / "o", fmt, group, symmetric)
    prompts = random_prompts(len(LENGTHS), LENGTHS, seed=7)
    llm = LLM(model=str(q), dtype="float32", kv_cache_memory=0.02, max_num_seqs=4,
              compilation_config={"mode": mode, "cache_dir": str(tmp_path / "cc")})
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[next(iter(s.values())).logprob for s in o.outputs[0].logprobs] for o in outs]
    hf_tokens, hf_logprobs = _hf(oracle, prompts, NEW_TOKENS)
    assert tokens == hf_tokens
    diff = max(abs(a - b) for ra, rb in zip(logprobs, hf_logprobs) for a, b in zip(ra, rb))
    assert diff < LOGPROB_TOL, diff


def _served_weight(layer) -> torch.Tensor:
    """The values a loaded 4-bit layer multiplies by, float32 [N, K], from what it holds."""
    return int4.dequantize_int4(layer.weight_packed, layer.weight_scale,
                                layer.weight_zero_point, layer.quant_method.group_size)


@pytest.mark.parametrize("fmt, group, symmetric", [
    ("compressed-tensors", 32, False), ("compressed-tensors", -1, True),
    ("compressed-tensors", 16, False), ("gptq", -1, False), ("awq", 64, False),
    ("awq", 16, False)])
def test_each_format_loads_exactly_the_dequantized_weights(src, tmp_path, fmt, group, symmetric):
    """Every linear of the loaded model (merged q/k/v and gate/up included) holds exactly the
    oracle's float weights in the canonical layout, its scales in the 16-bit dtype the
    checkpoint saved them in."""
    from safetensors.torch import load_file

    q, oracle = write_int4_checkpoint(src, tmp_path / "q", tmp_path / "o", fmt, group, symmetric)
    want = load_file(str(oracle / "model.safetensors"))
    model = get_model(kiln_config_for(q))
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    checked = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, LinearBase):
            continue
        prefix, _, leaf = name.rpartition(".")
        expected = torch.cat([want[f"{prefix}.{p}.weight"] for p in parts.get(leaf, (leaf,))])
        assert torch.equal(_served_weight(layer), expected), name
        assert layer.weight_scale.dtype == (torch.bfloat16 if fmt == "compressed-tensors"
                                            else torch.float16)
        checked += 1
    assert checked == 8


def _linears(model):
    return [m for m in model.modules() if isinstance(m, LinearBase)]


def test_weights_stay_4_bit_in_the_served_model(src, tmp_path):
    q, _ = write_int4_checkpoint(src, tmp_path / "q", tmp_path / "o", "compressed-tensors", 32)
    layers = _linears(get_model(kiln_config_for(q)))
    assert len(layers) == 8
    for layer in layers:
        n, k = layer.weight.shape
        assert layer.weight.is_meta and layer.cpu_packed is None  # no float copy held
        assert layer.cpu_blocks is None
        # 4 bits a value + a bfloat16 scale and a zero point byte per 32 values
        assert layer.weight_packed.numel() * 4 == n * k // 2
        assert int4_linear.bits_per_weight(layer.weight_packed, layer.weight_scale,
                                           layer.weight_zero_point) == 4 + 24 / 32
    # symmetric GPTQ stores zero points (all 8, the implied value): not kept
    q, _ = write_int4_checkpoint(src, tmp_path / "q2", tmp_path / "o2", "gptq", 32, True)
    for layer in _linears(get_model(kiln_config_for(q))):
        assert layer.weight_zero_point is None
        assert int4_linear.bits_per_weight(layer.weight_packed, layer.weight_scale,
                                           None) == 4 + 16 / 32


def _edited(src, tmp_path, fmt, group, edit, symmetric=False):
    q, _ = write_int4_checkpoint(src, tmp_path / "q", tmp_path / "o", fmt, group, symmetric)
    config = json.loads((q / "config.json").read_text())
    edit(config["quantization_config"])
    (q / "config.json").write_text(json.dumps(config))
    return q


def _weights(qc):
    return qc["config_groups"]["group_0"]["weights"]


@pytest.mark.parametrize("fmt, edit, field", [
    ("gptq", lambda qc: qc.update(desc_act=True), "desc_act=True"),
    ("gptq", lambda qc: qc.update(bits=8), "bits=8"),
    ("gptq", lambda qc: qc.update(checkpoint_format="gptq_v2"), "checkpoint_format='gptq_v2'"),
    ("awq", lambda qc: qc.update(version="gemv"), "version='gemv'"),
    ("awq", lambda qc: qc.update(zero_point=False), "zero_point=False"),
    ("compressed-tensors", lambda qc: qc.update(format="int-quantized"),
     "format='int-quantized'"),
    ("compressed-tensors", lambda qc: _weights(qc).update(group_size=48), "group_size=48"),
    ("compressed-tensors", lambda qc: _weights(qc).update(type="float"),
     "weights.type='float'"),
    # pack-quantized but not W4A16: the field that makes it so, not the format
    ("compressed-tensors", lambda qc: _weights(qc).update(num_bits=8), "weights.num_bits=8"),
    ("compressed-tensors", lambda qc: qc["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True,
                           "strategy": "token"}), r"group_0.input_activations=\{"),
], ids=["act-order", "gptq-8bit", "gptq-v2", "awq-gemv", "awq-no-zero", "ct-format",
        "group-not-dividing-k", "ct-float", "ct-w8a16", "ct-w4a8"])
def test_unsupported_4bit_schemes_are_refused_naming_the_field(src, tmp_path, fmt, edit, field):
    q = _edited(src, tmp_path, fmt, 32, edit)
    with pytest.raises(ConfigError, match=f"quantization_config.*{field}"):
        get_model(kiln_config_for(q))


def test_act_order_g_idx_is_refused_even_with_desc_act_false(src, tmp_path):
    from safetensors.torch import load_file, save_file

    q, _ = write_int4_checkpoint(src, tmp_path / "q", tmp_path / "o", "gptq", 32)
    state = load_file(str(q / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.g_idx"
    state[name] = state[name].flip(0).contiguous()
    save_file(state, str(q / "model.safetensors"))
    with pytest.raises(ConfigError, match="down_proj.g_idx.*desc_act"):
        get_model(kiln_config_for(q))


def test_a_gptq_checkpoint_without_g_idx_loads_in_order(src, tmp_path):
    """Older GPTQ tools saved no g_idx: groups in order, as desc_act false says."""
    from safetensors.torch import load_file, save_file

    q, oracle = write_int4_checkpoint(src, tmp_path / "q", tmp_path / "o", "gptq", 16)
    state = load_file(str(q / "model.safetensors"))
    save_file({k: v for k, v in state.items() if not k.endswith(".g_idx")},
              str(q / "model.safetensors"))
    want = load_file(str(oracle / "model.safetensors"))
    down = get_model(kiln_config_for(q)).model.layers[0].mlp.down_proj
    assert torch.equal(_served_weight(down), want["model.layers.0.mlp.down_proj.weight"])


def test_quantization_flag_must_match_the_checkpoint(src, tmp_path):
    q, _ = write_int4_checkpoint(src, tmp_path / "q", tmp_path / "o", "awq", 32)
    with pytest.raises(ConfigError, match="drop --quantization"):
        kiln_config_for(q, quantization="gptq")
    with pytest.raises(ConfigError, match="quant_method 'gptq'"):
        kiln_config_for(src, quantization="gptq")
    assert quantization_config("awq", 32, False)["version"] == "gemm"


def test_4bit_models_report_their_ops_and_refuse_moe_experts(src, tmp_path):
    from kiln.benchmarks.compile import _ops_in_use

    q, _ = write_int4_checkpoint(src, tmp_path / "q", tmp_path / "o", "awq", 32)
    config = kiln_config_for(q)
    assert config.model_config.quant_kind == "int4"
    ops = _ops_in_use(config)
    assert "int4_weight_linear" in ops and not {"gguf_linear", "gguf_embedding"} & set(ops)
    assert "int4_weight_linear" not in _ops_in_use(kiln_config_for(src))
    moe = make_tiny_checkpoint(tmp_path / "moe", "mixtral", tie=False, num_hidden_layers=1)
    config = json.loads((moe / "config.json").read_text())
    config["quantization_config"] = quantization_config("gptq", 32, True)
    (moe / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="4-bit weight-only experts of MixtralForCausalLM"):
        kiln_config_for(moe)


def test_awq_modules_to_not_convert_stay_float(src, tmp_path):
    q, _ = write_int4_checkpoint(src, tmp_path / "q", tmp_path / "o", "awq", 32,
                                 keep_float="layers.1.mlp")
    model = get_model(kiln_config_for(q))
    for name, layer in model.named_modules():
        if isinstance(layer, LinearBase):
            floats = name.startswith("model.layers.1.mlp")
            assert layer.weight.is_meta != floats and hasattr(layer, "int4_group") != floats
    config = json.loads((q / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["layers.0.self_attn.q_proj"]
    (q / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="modules_to_not_convert.*list all or none"):
        get_model(kiln_config_for(q))


# Families whose checkpoints store a linear fused (GPT-NeoX's per-head query_key_value, Phi-3's
# qkv_proj and gate_up_proj): each 4-bit tensor is split by the rows it keeps (GPTQ / AWQ in
# packed columns); Phi-3's key/value parts of 12 rows pad their packed zero points.
FUSED = {"gpt_neox": (("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"), {}),
         "phi3": (("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
                  dict(hidden_size=48, intermediate_size=80, num_key_value_heads=1))}


@pytest.mark.parametrize("arch, fmt, group, keep_float", [
    ("gpt_neox", "awq", 32, None), ("gpt_neox", "compressed-tensors", 16, None),
    ("phi3", "gptq", 16, None), ("phi3", "compressed-tensors", 16, None),
    # AWQ's modules_to_not_convert naming the fused module as Phi-3 stores it
    ("phi3", "awq", 16, "layers.0.self_attn.qkv_proj")])
def test_fused_checkpoint_linears_split_their_4bit_tensors(tmp_path, arch, fmt, group,
                                                          keep_float):
    linears, overrides = FUSED[arch]
    src = make_tiny_checkpoint(tmp_path / "f", arch, tie=False, num_hidden_layers=1, **overrides)
    q, oracle = write_int4_checkpoint(src, tmp_path / "q", tmp_path / "o", fmt, group,
                                      keep_float=keep_float, linears=linears)
    prompts = random_prompts(2, [3, 17], seed=7)
    llm = LLM(model=str(q), dtype="float32", kv_cache_memory=0.01, max_num_seqs=2,
              enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == _hf(oracle, prompts, 4)[0]
