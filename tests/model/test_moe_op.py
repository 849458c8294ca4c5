"""The IR op fused_moe against HF's sparse MoE blocks (routing, top-k, norm_topk_prob, the shared
expert), only routed experts run, expert weights split over TP ranks summing to the whole, and
the checkpoint names and refusals around the MoE families. float32 within 1e-5; bfloat16 within
a rounding step (HF rounds each expert's weighted output, the op sums in float32).
"""
import types

import pytest
import torch

from kiln import ir
from kiln.distributed.model_split import parallel_split_errors
from kiln.errors import ConfigError
from kiln.model.checkpoint_names import ExpertShard, merged_target
from kiln.model.layers.fused_moe import FusedMoE, SparseMoeBlock
from kiln.model.registry import MOE_ARCHITECTURES, ir_ops_not_called

E, K, H, INTER = 6, 2, 32, 24


def _hf_block(renormalize: bool, dtype: torch.dtype, shared: bool = False):
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    kw = dict(hidden_size=H, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=K,
              norm_topk_prob=renormalize)
    torch.manual_seed(0)
    if shared:
        block = Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(shared_expert_intermediate_size=40, **kw))
    else:
        block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**kw))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block.to(dtype).eval()


def _close(got, want, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_moe_matches_hf_block(renormalize, dtype):
    block = _hf_block(renormalize, dtype)
    x = torch.randn(19, H, generator=torch.Generator().manual_seed(1)).to(dtype)
    logits = torch.nn.functional.linear(x, block.gate.weight)
    got = ir.fused_moe.reference(x, logits, block.experts.gate_up_proj.data,
                                 block.experts.down_proj.data, K, renormalize)
    with torch.no_grad():
        want = block(x.unsqueeze(0))[0]
    assert got.dtype == dtype
    _close(got, want, dtype)


def _kiln_block(hf_block, shared_size: int, renormalize: bool, tp_rank=0, tp_size=1):
    """Kiln's SparseMoeBlock with hf_block's weights, loaded through the checkpoint names."""
    config = types.SimpleNamespace(hidden_size=H, num_experts_per_tok=K, hidden_act="silu",
                                   intermediate_size=64, model_type="qwen2_moe")
    kiln = SparseMoeBlock(config, "mlp", num_experts=E, intermediate_size=INTER,
                          renormalize=renormalize, shared_size=shared_size)
    if tp_size > 1:  # the experts alone, as a rank of tp_size holds them
        kiln.experts = FusedMoE(E, K, H, INTER, renormalize, tp_rank=tp_rank, tp_size=tp_size)
    params = {f"mlp.{name}": p for name, p in kiln.named_parameters()}
    gate_up, down = hf_block.experts.gate_up_proj.data, hf_block.experts.down_proj.data
    for e in range(E):
        per_expert = {f"mlp.experts.{e}.gate_proj.weight": gate_up[e, :INTER],
                      f"mlp.experts.{e}.up_proj.weight": gate_up[e, INTER:],
                      f"mlp.experts.{e}.down_proj.weight": down[e]}
        for name, tensor in per_expert.items():
            target, shard = merged_target(name)
            params[target].weight_loader(params[target], tensor, shard)
    params["mlp.gate.weight"].data.copy_(hf_block.gate.weight.data)
    if shared_size:
        for part, shard in (("gate_proj", 0), ("up_proj", 1), ("down_proj", None)):
            target, s = merged_target(f"mlp.shared_expert.{part}.weight")
            assert s == shard
            tensor = getattr(hf_block.shared_expert, part).weight.data
            params[target].weight_loader(params[target], tensor, *(() if s is None else (s,)))
        params["mlp.shared_expert_gate.weight"].data.copy_(hf_block.shared_expert_gate.weight)
    return kiln


def test_block_with_shared_expert_matches_qwen2_moe():
    hf = _hf_block(False, torch.float32, shared=True)
    kiln = _kiln_block(hf, 40, False)
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _close(kiln(x), hf(x.unsqueeze(0))[0], torch.float32)


def test_expert_shards_over_two_ranks_sum_to_the_whole():
    hf = _hf_block(True, torch.float32)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(3))
    logits = torch.nn.functional.linear(x, hf.gate.weight)
    parts = [_kiln_block(hf, 0, True, rank, 2).experts for rank in (0, 1)]
    assert parts[0].w13_weight.shape == (E, INTER, H) and parts[0].w2_weight.shape == (E, H, 12)
    with torch.no_grad():
        total = sum(p(x, logits) for p in parts)
        _close(total, hf(x.unsqueeze(0))[0], torch.float32)


def test_only_routed_experts_run():
    hf = _hf_block(True, torch.float32)
    w13, w2 = hf.experts.gate_up_proj.data.clone(), hf.experts.down_proj.data.clone()
    w13[3], w2[3] = float("nan"), float("nan")  # an expert no token is routed to
    x = torch.randn(5, H)
    logits = torch.randn(5, E)
    logits[:, 3] = -1e4
    out = ir.fused_moe.reference(x, logits, w13, w2, K, True)
    assert torch.isfinite(out).all()
    empty = ir.fused_moe.reference(x[:0], logits[:0], w13, w2, K, True)
    assert empty.shape == (0, H)


def test_checkpoint_names_map_to_stacked_experts():
    assert merged_target("model.layers.3.mlp.experts.7.w1.weight") == (
        "model.layers.3.mlp.experts.w13_weight", ExpertShard(7, "w1"))
    assert merged_target("model.layers.0.mlp.experts.12.up_proj.weight") == (
        "model.layers.0.mlp.experts.w13_weight", ExpertShard(12, "w3"))
    assert merged_target("model.layers.0.mlp.experts.1.down_proj.weight") == (
        "model.layers.0.mlp.experts.w2_weight", ExpertShard(1, "w2"))
    # the shared expert is a dense MLP: its gate / up merge as Llama's do
    assert merged_target("model.layers.0.mlp.shared_expert.gate_proj.weight") == (
        "model.layers.0.mlp.shared_expert.gate_up_proj.weight", 0)
    assert str(ExpertShard(3, "w3")) == "expert 3 w3"


def test_an_expert_past_the_config_is_refused():
    moe = FusedMoE(4, 2, H, INTER, True, tp_rank=0, tp_size=1)
    with pytest.raises(ConfigError, match="expert 4 is past the config's 4 experts"):
        moe.weight_loader(moe.w2_weight, torch.zeros(H, INTER), ExpertShard(4, "w2"))
    with pytest.raises(ConfigError, match=r"num_experts_per_tok \(5\) must be between 1 and"):
        FusedMoE(4, 5, H, INTER, True, tp_rank=0, tp_size=1)


def test_tp_split_names_the_moe_sizes():
    cfg = types.SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                intermediate_size=64, moe_intermediate_size=30,
                                shared_expert_intermediate_size=45)
    errors = parallel_split_errors(cfg, 4, 1)
    assert errors == ["moe_intermediate_size (30) is not divisible by tensor_parallel_size (4)",
                      "shared_expert_intermediate_size (45) is not divisible by "
                      "tensor_parallel_size (4)"]


def test_fused_moe_is_listed_for_moe_families_only():
    for arch in MOE_ARCHITECTURES:
        assert "fused_moe" not in ir_ops_not_called(arch)
    assert "fused_moe" in ir_ops_not_called("LlamaForCausalLM")


def _recorded_work(x, logits, w13, w2):
    """The torch provider's aten calls and their argument shapes: what a CUDA graph records."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
            calls.append((str(func), shapes))
            return func(*args, **(kwargs or {}))

    with Record():
        out = ir.fused_moe.impls["torch"].fn(x, logits, w13, w2, K, True)
    return calls, out


def test_a_recorded_cuda_graph_holds_for_any_routing(monkeypatch):
    """While a CUDA graph is recorded (mode 3's default on CUDA), the op reads nothing on the
    host and does the same work whatever the routing (the graph replays it for every later
    batch), with the reference's result; no-one-routed experts' NaNs stay out."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    hf = _hf_block(True, torch.float32)
    w13, w2 = hf.experts.gate_up_proj.data.clone(), hf.experts.down_proj.data.clone()
    w13[5], w2[5] = float("nan"), float("nan")
    x = torch.randn(7, H)
    recorded = []
    for seed in (0, 1):
        logits = torch.randn(7, E, generator=torch.Generator().manual_seed(seed))
        logits[:, 5] = -1e4
        if seed:  # another routing: every token on experts 0 and 1
            logits[:, :2] += 100
        calls, out = _recorded_work(x, logits, w13, w2)
        assert not [c for c, _ in calls if "_local_scalar_dense" in c or "item" in c]
        _close(out, ir.fused_moe.reference(x, logits, w13, w2, K, True), torch.float32)
        recorded.append(calls)
    assert recorded[0] == recorded[1]
