"""HF configs of GGUF mixture-of-experts files, built from the metadata as llama.cpp reads it:
Mixtral (architecture llama with expert_count > 0), Qwen2-MoE (qwen2moe), Qwen3-MoE (qwen3moe).

transformers converts none of them whole: it reads a Mixtral file as a dense Llama, drops the
experts' and shared expert's sizes and Qwen3-MoE's renormalized routing (llama.cpp hard-codes it).
"""
from kiln.config.gguf_arch_config import common_fields, values

# general.architecture -> (transformers' config class, the architecture Kiln serves it as,
# whether llama.cpp renormalizes the top-k routing weights: its graph's norm_w)
MOE_ARCHITECTURES = {"llama": ("MixtralConfig", "MixtralForCausalLM", True),
                     "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", False),
                     "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", True)}
# the MoE metadata read (besides expert_count, which gguf_checks reads); llama.cpp reads no
# gating function or weight scale for these architectures (softmax, unscaled), nor does Kiln
MOE_KEYS = ("expert_used_count", "expert_feed_forward_length",
            "expert_shared_feed_forward_length")


def metadata_keys(arch: str | None) -> list[str]:
    """The metadata keys read here (kept in the tensor table)."""
    return [f"{arch}.{key}" for key in MOE_KEYS] if arch in MOE_ARCHITECTURES else []


def is_moe(table: dict) -> bool:
    """Whether a file is one of MOE_ARCHITECTURES' mixtures of experts (a llama file only with
    expert_count > 0: without, it is a dense Llama)."""
    arch = table["architecture"]
    if arch not in MOE_ARCHITECTURES:
        return False
    count = table["metadata"].get(f"{arch}.expert_count", {}).get("value")
    return arch != "llama" or (isinstance(count, int) and count > 0)


def sparse_layers(table: dict) -> set[int]:
    """The layers whose feed-forward is experts: those with a router (ffn_gate_inp)."""
    return {int(t["name"].split(".")[1]) for t in table["tensors"]
            if t["name"].startswith("blk.") and t["name"].endswith(".ffn_gate_inp.weight")}


def build_config(table: dict):
    """transformers' config of an is_moe file, sized as llama.cpp sizes the tensors: Mixtral's
    experts by feed_forward_length; Qwen's by expert_feed_forward_length, else
    feed_forward_length / expert_used_count; Qwen2-MoE's shared expert by
    expert_shared_feed_forward_length, else feed_forward_length."""
    import transformers

    arch = table["architecture"]
    cls_name, architecture, renormalize = MOE_ARCHITECTURES[arch]
    meta = values(table)

    def key(name, default=None):
        return meta.get(f"{arch}.{name}", default)

    fields = {"architectures": [architecture], **common_fields(table)}
    experts, used, dense_size = key("expert_count"), key("expert_used_count"), \
        fields["intermediate_size"]
    head_dim = key("attention.key_length",
                   fields["hidden_size"] // fields["num_attention_heads"])
    fields.update(num_experts_per_tok=used, head_dim=head_dim)
    if arch == "llama":
        fields.update(num_local_experts=experts, sliding_window=None)
        return getattr(transformers, cls_name)(**fields)
    moe_size = key("expert_feed_forward_length") or dense_size // used
    # a layer without a router is a dense MLP (llama.cpp has none; HF's mlp_only_layers)
    sparse = sparse_layers(table)
    fields.update(num_experts=experts, moe_intermediate_size=moe_size,
                  norm_topk_prob=renormalize, decoder_sparse_step=1,
                  mlp_only_layers=[i for i in range(fields["num_hidden_layers"])
                                   if i not in sparse])
    if arch == "qwen2moe":
        fields.update(qkv_bias=fields.pop("attention_bias"), use_sliding_window=False,
                      shared_expert_intermediate_size=key("expert_shared_feed_forward_length")
                      or dense_size)
    return getattr(transformers, cls_name)(**fields)
