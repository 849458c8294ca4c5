"""DeepSeek's expert routing (the model computes it; the fused_moe op runs the experts it picks):
V2's softmax top-k, greedy or group-limited, and V3's noaux_tc (sigmoid scores, a per-expert
correction bias for the choice only, groups ranked by their two best).

`routing_of` reads and checks the config once; `deepseek_topk` is a pure function of the logits.
"""
from dataclasses import dataclass

import torch

from kiln.errors import ConfigError

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class DeepseekRouting:
    top_k: int
    num_experts: int
    method: str  # one of TOPK_METHODS
    scoring: str  # one of SCORING_FUNCS
    n_group: int  # 1: no grouping
    topk_group: int
    renormalize: bool  # norm_topk_prob
    scaling_factor: float  # routed_scaling_factor

    @property
    def uses_bias(self) -> bool:
        """noaux_tc's e_score_correction_bias (a checkpoint tensor of the gate)."""
        return self.method == "noaux_tc"


def routing_of(hf_config, v3: bool) -> DeepseekRouting:
    """The config's routing, checked: V3 checkpoints default to noaux_tc over sigmoid scores
    (HF's DeepseekV3 always routes so), V2 to greedy softmax. norm_topk_prob is honoured for
    both, as vLLM and DeepSeek's own code do (HF's V2 class ignores it)."""
    experts = int(hf_config.n_routed_experts)
    method = getattr(hf_config, "topk_method", None) or ("noaux_tc" if v3 else "greedy")
    scoring = getattr(hf_config, "scoring_func", None) or ("sigmoid" if v3 else "softmax")
    if method not in TOPK_METHODS:
        raise ConfigError(f"topk_method {method!r} is not supported; supported: "
                          f"{', '.join(TOPK_METHODS)}")
    if scoring not in SCORING_FUNCS:
        raise ConfigError(f"scoring_func {scoring!r} is not supported; supported: "
                          f"{', '.join(SCORING_FUNCS)}")
    top_k = int(hf_config.num_experts_per_tok or 0)
    n_group, topk_group = 1, 1
    if method != "greedy":
        n_group = int(getattr(hf_config, "n_group", None) or 0)
        topk_group = int(getattr(hf_config, "topk_group", None) or 0)
        if n_group < 1 or experts % n_group:
            raise ConfigError(f"n_group ({n_group}) must divide n_routed_experts ({experts}) "
                              f"for topk_method {method!r}")
        if not 1 <= topk_group <= n_group:
            raise ConfigError(f"topk_group ({topk_group}) must be between 1 and n_group "
                              f"({n_group})")
        per_group = experts // n_group
        if method == "noaux_tc" and per_group < 2:
            raise ConfigError(f"noaux_tc ranks each group by its two best experts; n_group "
                              f"({n_group}) leaves {per_group} per group")
        if top_k > topk_group * per_group:
            raise ConfigError(f"num_experts_per_tok ({top_k}) is more than the experts of "
                              f"topk_group ({topk_group}) groups of {per_group}")
    return DeepseekRouting(top_k, experts, method, scoring, n_group, topk_group,
                           bool(getattr(hf_config, "norm_topk_prob", False)),
                           float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0))


def deepseek_topk(router_logits: torch.Tensor, r: DeepseekRouting,
                  correction_bias: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights float32 [T, k], expert ids int64 [T, k])."""
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if r.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if r.method != "greedy":
        grouped = choice.view(-1, r.n_group, r.num_experts // r.n_group)  # [T, G, E/G]
        if r.method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        else:
            group_scores = grouped.max(dim=-1).values
        groups = torch.topk(group_scores, k=r.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape(-1, r.num_experts)  # [T, E]
        # V2 zeroes the other groups' scores, V3 excludes them outright (as HF)
        choice = choice.masked_fill(~keep, float("-inf") if r.method == "noaux_tc" else 0.0)
    ids = torch.topk(choice, k=r.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if r.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * r.scaling_factor, ids
