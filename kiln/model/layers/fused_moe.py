"""Mixture-of-experts layers: the experts' stacked weights (`FusedMoE`, filled from HF's per-expert
tensors) and the sparse block around them (router, experts, Qwen2-MoE's gated shared expert).

Under tensor parallelism each expert's intermediate dimension is split across ranks, as a dense
MLP's is; the block sums the ranks' partial outputs once, after the experts and shared expert.
"""
import torch
from torch import nn

from kiln import ir
from kiln.distributed.communication_op import tensor_model_parallel_all_reduce
from kiln.errors import ConfigError
from kiln.model.checkpoint_names import ExpertShard
from kiln.model.layers.linear import (
    ReplicatedLinear,
    _split,
    check_scale,
    default_weight_loader,
    take_shard,
    tp_rank_and_size,
)


def num_experts_of(hf_config) -> int:
    """The expert count: `num_experts` (Qwen MoE checkpoints) or `num_local_experts` (Mixtral,
    and what transformers 5 writes for both; its attribute_map, which aliases them, is not kept in
    a config snapshot)."""
    value = getattr(hf_config, "num_experts", None)
    if value is None:
        value = getattr(hf_config, "num_local_experts", 0)
    return int(value or 0)


class FusedMoE(nn.Module):
    """`num_experts` SiLU-gated MLPs as two stacked tensors: w13_weight [E, 2 I_rank, H] (each
    expert's gate rows, then its up rows) and w2_weight [E, H, I_rank], I_rank this rank's share
    of the intermediate size. forward(x, router_logits) is the IR op fused_moe: this rank's
    partial sum, which the caller all-reduces."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, tp_rank: int | None = None, tp_size: int | None = None):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ConfigError(f"num_experts_per_tok ({top_k}) must be between 1 and the number "
                              f"of experts ({num_experts})")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_rank, tp_size)
        self.local_size = _split(intermediate_size, self.tp_size, "the experts' intermediate size")
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.local_size, hidden_size),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.local_size),
                                      requires_grad=False)
        for param, parts in ((self.w13_weight, ("w1", "w3")), (self.w2_weight, ("w2",))):
            param.weight_loader = self.weight_loader
            # what load_weights checks the checkpoint filled (each expert's own tensors)
            param.shard_ids = [ExpertShard(e, p) for e in range(num_experts) for p in parts]
        # W8A8 int8 (kiln/model/layers/quantization/moe_int8.py): float32 [E, 2 I_rank] and
        # [E, H], one scale per expert and output channel, beside int8 weights
        self.register_parameter("w13_weight_scale", None)
        self.register_parameter("w2_weight_scale", None)
        # for the native int8 kernels (kiln/model/layers/moe_cpu.py): int8 experts in VNNI
        # panels. Float experts run natively on w13_weight / w2_weight as they are.
        self.register_buffer("w13_panels", None, persistent=False)
        self.register_buffer("w2_panels", None, persistent=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: ExpertShard | None = None) -> None:
        if not isinstance(shard_id, ExpertShard):
            raise ValueError("stacked expert weights load one expert's tensor at a time")
        if not 0 <= shard_id.expert < self.num_experts:
            raise ConfigError(f"expert {shard_id.expert} is past the config's {self.num_experts} "
                              "experts (num_local_experts / num_experts)")
        size, rank, ranks = self.local_size, self.tp_rank, self.tp_size
        if param.dim() == 2:  # a stacked scale: compressed-tensors stores each [N, 1]
            loaded = check_scale(loaded).reshape(-1)
            if shard_id.part == "w2":  # per output channel: whole on every rank, like a bias
                default_weight_loader(param.data[shard_id.expert], loaded)
                return
        if shard_id.part == "w2":  # [H, I]: this rank's columns
            default_weight_loader(param.data[shard_id.expert],
                                  take_shard(loaded, 1, rank, size, ranks))
            return
        rows = param.data[shard_id.expert].narrow(0, 0 if shard_id.part == "w1" else size, size)
        default_weight_loader(rows, take_shard(loaded, 0, rank, size, ranks))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor,
                topk_weights: torch.Tensor | None = None,
                topk_ids: torch.Tensor | None = None) -> torch.Tensor:
        # x [T, H], router_logits [T, E] -> [T, H], this rank's partial sum; topk_weights /
        # topk_ids [T, k]: the model's own routing (DeepSeek's), else the op's softmax top-k
        if self.w13_panels is not None:
            return ir.fused_moe_int8_panels(x, router_logits, self.w13_panels,
                                            self.w13_weight_scale, self.w2_panels,
                                            self.w2_weight_scale, self.top_k, self.renormalize,
                                            topk_weights, topk_ids)
        if self.w13_weight_scale is not None:
            return ir.fused_moe_int8(x, router_logits, self.w13_weight, self.w13_weight_scale,
                                     self.w2_weight, self.w2_weight_scale, self.top_k,
                                     self.renormalize, topk_weights, topk_ids)
        return ir.fused_moe(x, router_logits, self.w13_weight, self.w2_weight, self.top_k,
                            self.renormalize, topk_weights, topk_ids)


class SparseMoeBlock(nn.Module):
    """HF's sparse MoE block: `gate` (the router, [E, H], never quantized or split), `experts`,
    and with `shared_size` a shared expert every token runs, scaled by sigmoid(shared_expert_gate
    x) (Qwen2-MoE). Checkpoint names follow: gate, experts.N.*, shared_expert.*,
    shared_expert_gate."""

    def __init__(self, hf_config, prefix: str, *, num_experts: int, intermediate_size: int,
                 renormalize: bool, shared_size: int = 0):
        super().__init__()
        from kiln.model.llama import LlamaMLP  # the dense MLP: the shared expert's shape

        hidden = hf_config.hidden_size
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ConfigError(f"{prefix}: hidden_act {hf_config.hidden_act!r} is not supported "
                              "for experts; only 'silu'")
        self.gate = ReplicatedLinear(hidden, num_experts, bias=False)
        # online int8 leaves the routers in the model dtype, as vLLM (a checkpoint's
        # quantization_config decides for its own)
        self.gate.online_quantization = False
        self.experts = FusedMoE(num_experts, hf_config.num_experts_per_tok, hidden,
                                intermediate_size, renormalize)
        self.tp_size = self.experts.tp_size
        if shared_size:
            self.shared_expert = LlamaMLP(hf_config, f"{prefix}.shared_expert", shared_size,
                                          reduce_results=False)
            self.shared_expert_gate = ReplicatedLinear(hidden, 1, bias=False)
            self.shared_expert_gate.online_quantization = False
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))  # [T, H]
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return tensor_model_parallel_all_reduce(out) if self.tp_size > 1 else out
