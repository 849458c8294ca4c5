"""W8A8 int8 for the MoE families: the IR op fused_moe_int8 equals the dense int8 ops run per
routed expert (bit for bit), its CUDA-graph form equals it; online `quantization="int8"` quantizes
experts per expert and channel, attention and the shared expert as the dense path, and leaves the
routers float; compressed-tensors MoE checkpoints load; modes 0 and 3 give the same greedy
tokens; and int8 keeps top-1 agreement with float (teacher-forced) >= MIN_AGREEMENT.

Measured on the tiny random Qwen3-MoE / Mixtral (float32, 3 prompts + 8 greedy tokens): 1.0.
The bound, 0.9, is the default model's (tests/quantization/test_int8_quality.py).
"""
import pytest
import torch
from model._attn_helper import kiln_config_for
from safetensors.torch import load_file

from kiln import LLM, SamplingParams, ir
from kiln.ir import quant
from kiln.model.layers.fused_moe import FusedMoE
from kiln.model.layers.linear import LinearBase
from kiln.model.layers.moe_cpu import int8_expert_weight
from kiln.model.layers.quantization.compressed_tensors import UnsupportedQuantization
from kiln.model.layers.quantization.moe_int8 import quantize_experts
from kiln.model.layers.quantization.w8a8_int8 import Int8W8A8Config, int8_weight
from kiln.model.loader import build_model, get_model
from kiln.native import int8_ops

from w8a8_checkpoint import write_w8a8_checkpoint

E, K, H, INTER = 5, 2, 48, 40
PROMPTS = [[5, 6, 7, 8, 9], [300, 301, 302, 40, 41, 42, 43, 44, 45, 46, 47], [77]]
MIN_AGREEMENT = 0.9


def _experts(dtype):
    moe = FusedMoE(E, K, H, INTER, renormalize=True, tp_rank=0, tp_size=1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        moe.w13_weight.copy_(torch.randn(E, 2 * INTER, H, generator=g) * 0.2)
        moe.w2_weight.copy_(torch.randn(E, H, INTER, generator=g) * 0.2)
    quantize_experts(moe)
    x = torch.randn(13, H, generator=g).to(dtype)
    logits = torch.randn(13, E, generator=g).to(dtype)
    return moe, x, logits


def _dense_int8_per_expert(moe, x, logits):
    """Each token's top-k experts run through the dense path's bound int8 ops (as a quantized
    LlamaMLP calls them), summed in float32 in expert order."""
    weights, ids = ir.moe.route(logits, K, True)
    out = torch.zeros(x.shape[0], H)
    for t in range(x.shape[0]):
        for slot in ids[t].argsort():
            e = ids[t, slot].item()
            q, s = quant.dynamic_int8_quant(x[t:t + 1])
            gate_up = quant.int8_scaled_mm(q, s, moe.w13_weight[e], moe.w13_weight_scale[e],
                                           None, x.dtype)
            q, s = quant.dynamic_int8_quant(ir.silu_and_mul(gate_up))
            y = quant.int8_scaled_mm(q, s, moe.w2_weight[e], moe.w2_weight_scale[e], None,
                                     x.dtype)
            out[t] += y[0].float() * weights[t, slot]
    return out.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_equals_the_dense_int8_ops_per_expert(dtype):
    moe, x, logits = _experts(dtype)
    assert moe.w13_weight.dtype == torch.int8 and moe.w13_weight_scale.shape == (E, 2 * INTER)
    assert moe.w2_weight.dtype == torch.int8 and moe.w2_weight_scale.shape == (E, H)
    got = moe(x, logits)
    assert got.dtype == dtype
    assert torch.equal(got, _dense_int8_per_expert(moe, x, logits))
    # and within int8's error of the float experts it came from
    w13 = moe.w13_weight.float() * moe.w13_weight_scale.unsqueeze(-1)
    w2 = moe.w2_weight.float() * moe.w2_weight_scale.unsqueeze(-1)
    want = ir.fused_moe.reference(x.float(), logits, w13, w2, K, True)
    assert (got.float() - want).abs().max() <= 0.05 * want.abs().max()


def test_a_recorded_cuda_graph_form_is_equal_and_reads_nothing(monkeypatch):
    """While a CUDA graph records, every expert runs on every token, nothing read to the host;
    per-token quantization and exact int32 sums make it equal to the reference."""
    from torch.utils._python_dispatch import TorchDispatchMode

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    moe, x, logits = _experts(torch.float32)
    args = (x, logits, moe.w13_weight, moe.w13_weight_scale, moe.w2_weight, moe.w2_weight_scale,
            K, True)
    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            calls.append(str(func))
            return func(*a, **(kw or {}))

    with Record():
        out = ir.fused_moe_int8.impls["torch"].fn(*args)
    assert not [c for c in calls if "_local_scalar_dense" in c or "item" in c]
    assert torch.equal(out, ir.fused_moe_int8.reference(*args))


def _generate(llm, prompts=PROMPTS, max_tokens=8):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _top1(llm, sequences):
    """Each position's most likely next token (teacher forcing on `sequences`)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    return [[next(t for t, lp in entry.items() if lp.rank == 1) for entry in o.prompt_logprobs[1:]]
            for o in outs]


def test_online_int8_quantizes_experts_and_keeps_routers_float(tiny_qwen2_moe_dir):
    model = get_model(kiln_config_for(tiny_qwen2_moe_dir, quantization="int8"))
    linears = {n: m for n, m in model.named_modules() if isinstance(m, LinearBase)}
    for name, layer in linears.items():
        router = name.endswith((".mlp.gate", ".shared_expert_gate"))
        assert (layer.weight.dtype == torch.float32) == (router or name == "lm_head"), name
    assert any(".shared_expert." in n and int8_weight(m).dtype == torch.int8
               for n, m in linears.items())
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(m.w13_weight.dtype == m.w2_weight.dtype == torch.int8
                           for m in experts)


def test_online_int8_qwen3_moe_modes_0_and_3_agree_and_track_float(
        tiny_qwen3_moe_dir, tmp_path, inprocess_core):
    from kiln.compilation.passes import lower_ir

    base = dict(model=str(tiny_qwen3_moe_dir), dtype="float32", max_model_len=64)
    floats = LLM(**base, enforce_eager=True)
    sequences = [p + t for p, t in zip(PROMPTS, _generate(floats))]
    want = _top1(floats, sequences)
    del floats
    eager = LLM(**base, quantization="int8", enforce_eager=True)
    eager_tokens, got = _generate(eager), _top1(eager, sequences)
    del eager
    lower_ir.reset_record()
    compiled = LLM(**base, quantization="int8",
                   compilation_config={"mode": 3, "cache_dir": str(tmp_path / "cc")})
    # one opaque node; on a panel CPU the experts were packed at load (kiln/model/layers/
    # moe_cpu.py) and the panels op runs them natively
    op = "fused_moe_int8_panels" if int8_ops.panel_cpu() else "fused_moe_int8"
    assert lower_ir.lowered_providers()[op] == {"native" if int8_ops.isa() else "torch"}
    assert _generate(compiled) == eager_tokens
    pairs = [(a, b) for g, w in zip(got, want) for a, b in zip(g, w)]
    assert sum(a == b for a, b in pairs) / len(pairs) >= MIN_AGREEMENT


@pytest.mark.parametrize("arch, router", [("mixtral", "re:.*block_sparse_moe.gate$"),
                                          ("qwen2_moe", "re:.*mlp.(shared_expert_)?gate$")])
def test_compressed_tensors_moe_checkpoint_loads(arch, router, request, tmp_path):
    """llm-compressor's layout (each expert's w1 / w3 / w2 or gate / up / down_proj an int8
    weight and weight_scale [N, 1], routers ignored) loads into the stacked int8 experts, and
    generates the online-int8 model's greedy tokens (the same per-channel rounding)."""
    src = request.getfixturevalue(f"tiny_{arch}_dir")
    dst = write_w8a8_checkpoint(src, tmp_path / "w8a8", scale_dtype=torch.bfloat16,
                                ignore=["lm_head", router])
    model = get_model(kiln_config_for(dst))
    stored = load_file(dst / "model.safetensors")
    moe_name = "block_sparse_moe" if arch == "mixtral" else "mlp"
    w1, w2 = ("w1", "w2") if arch == "mixtral" else ("gate_proj", "down_proj")
    moe = model.model.layers[0].mlp.experts
    prefix = f"model.layers.0.{moe_name}.experts.3"
    assert torch.equal(int8_expert_weight(moe, "w13")[3, :moe.local_size],
                       stored[f"{prefix}.{w1}.weight"])
    assert torch.equal(moe.w2_weight_scale[3],
                       stored[f"{prefix}.{w2}.weight_scale"].float().reshape(-1))
    assert model.model.layers[0].mlp.gate.weight.dtype == torch.float32
    kw = dict(dtype="float32", enforce_eager=True, max_model_len=64)
    assert _generate(LLM(model=str(dst), **kw)) == \
        _generate(LLM(model=str(src), quantization="int8", **kw))


def test_experts_quantized_in_part_are_refused(tiny_mixtral_dir):
    model = build_model(kiln_config_for(tiny_mixtral_dir))
    config = Int8W8A8Config(online=False, targets=["Linear"],
                            ignore=["lm_head", "re:.*gate$", "re:.*experts.2.w3$"])
    with pytest.raises(UnsupportedQuantization, match=r"quantization_config.ignore=.*the parts "
                       r"of model.layers.0.mlp.experts .*must all be quantized or all left"):
        config.expert_layers(model)


@pytest.mark.parametrize("router", ["re:.*block_sparse_moe.gate", "re:.*mlp.gate$",
                                    "model.layers.0.mlp.gate"])
def test_mixtral_router_ignored_by_either_name_stays_float(tiny_mixtral_dir, router):
    """Mixtral's checkpoint names its block `block_sparse_moe`; transformers 5 (and so
    llm-compressor run under it) names it `mlp`. An ignore list in either spelling leaves the
    router float: the transformers 5 one was read as quantized and the float router refused
    as 'checkpoint dtype torch.float32 where torch.int8 is expected'."""
    model = build_model(kiln_config_for(tiny_mixtral_dir))
    config = Int8W8A8Config(online=False, ignore=["lm_head", router, "model.layers.1.mlp.gate"])
    chosen = {name for name, _ in config.layers(model)}
    assert "model.layers.0.mlp.gate" not in chosen
    assert "model.layers.0.self_attn.qkv_proj" in chosen
    assert len(config.expert_layers(model)) == 2
