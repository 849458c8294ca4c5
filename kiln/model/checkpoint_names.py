"""HF checkpoint tensor names against Kiln's parameters: the merged projections' parts, the experts'
stacked tensors, the bias tensors a config implies, and why a tensor fits no parameter."""
import re
from typing import NamedTuple

from kiln.errors import ConfigError


def config_bias(hf_config, field: str) -> bool:
    """`attention_bias` / `mlp_bias` as HF's class for the config reads it: Llama and Granite
    read both, Qwen2, Qwen3, Gemma, OLMo-2 and Cohere no mlp_bias, Mistral and Phi-3 neither (a
    checkpoint with the flag set and no such tensors was refused as missing them, where HF
    loads it); OLMo-3 and GLM-4 attention_bias only, EXAONE-4 neither; ERNIE-4.5's one
    use_bias stands for both."""
    model_type = getattr(hf_config, "model_type", "llama")
    if model_type == "ernie4_5":
        return bool(getattr(hf_config, "use_bias", False))
    reads = {"mistral": (), "phi3": (), "gemma": ("attention_bias",),
             "olmo2": ("attention_bias",), "qwen2": ("attention_bias",),
             "qwen3": ("attention_bias",), "mixtral": (), "qwen2_moe": (),
             "qwen3_moe": ("attention_bias",),
             "cohere": ("attention_bias",), "olmo3": ("attention_bias",),
             "glm4": ("attention_bias",), "exaone4": (), "deepseek_v3": ("attention_bias",)}
    return field in reads.get(model_type, (field,)) and bool(getattr(hf_config, field, False))


# (merged param, HF name part, shard id)
STACKED_PARAMS = [
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
]


class ExpertShard(NamedTuple):
    """One expert's part of a stacked expert tensor: w1 (gate), w3 (up) of w13_weight, or w2
    (down) of w2_weight (kiln/model/layers/fused_moe.py)."""
    expert: int
    part: str

    def __str__(self) -> str:
        return f"expert {self.expert} {self.part}"


# each expert's own tensor: Mixtral's w1 / w3 / w2, the Qwen MoEs' gate / up / down_proj
# (and, W8A8 int8, its weight_scale)
_EXPERT_TENSOR = re.compile(
    r"\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.(weight|weight_scale)$")
_EXPERT_PARTS = {"w1": "w1", "gate_proj": "w1", "w3": "w3", "up_proj": "w3", "w2": "w2",
                 "down_proj": "w2"}


# transformers 5's own layout of a layer's experts (its checkpoints since, and any re-saved with
# save_original_format=False): every expert in two 3-D tensors, no ".weight" suffix
_FUSED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


def split_fused_experts(name: str, tensor) -> list[tuple[str, object]] | None:
    """Each expert's own tensors (as older checkpoints name them) of a fused expert tensor:
    experts.gate_up_proj [E, 2I, H] (each expert's gate rows, then its up rows, as HF's chunk)
    or experts.down_proj [E, H, I]; None for any other tensor. Kiln refused such checkpoints
    as not matching their config, where transformers and vLLM load them."""
    fused = _FUSED_EXPERTS.search(name)
    if fused is None:
        return None
    prefix, part = name[:fused.start()], fused.group(1)
    if tensor.dim() != 3 or (part == "gate_up_proj" and tensor.shape[1] % 2):
        want = "[experts, 2 x intermediate, hidden]" if part == "gate_up_proj" else \
            "[experts, hidden, intermediate]"
        raise ConfigError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected "
                          f"{want}; the checkpoint does not match its config")
    if part == "down_proj":
        return [(f"{prefix}.experts.{e}.down_proj.weight", tensor[e])
                for e in range(tensor.shape[0])]
    gates, ups = tensor.chunk(2, dim=1)  # [E, I, H] each
    return [(f"{prefix}.experts.{e}.{kind}.weight", half[e])
            for e in range(tensor.shape[0]) for kind, half in (("gate_proj", gates),
                                                                ("up_proj", ups))]


def merged_target(name: str) -> tuple[str, str | int | ExpertShard | None]:
    """(Kiln parameter name, shard id) for an HF tensor name; shard id None when unmerged."""
    expert = _EXPERT_TENSOR.search(name)
    if expert is not None:
        part = _EXPERT_PARTS[expert.group(2)]
        stacked = ("w2_" if part == "w2" else "w13_") + expert.group(3)
        return (f"{name[:expert.start()]}.experts.{stacked}",
                ExpertShard(int(expert.group(1)), part))
    for merged, part, shard_id in STACKED_PARAMS:
        if part + "." in name:
            return name.replace(part + ".", merged + "."), shard_id
    return name, None


def checkpoint_parts(name: str) -> list[tuple[str, str | int | None]]:
    """(HF tensor name, shard id) of each checkpoint tensor that fills Kiln parameter `name`
    (merged_target's inverse): a merged one's parts, else the name itself with shard None."""
    parts = [(name.replace(m + ".", p + "."), s) for m, p, s in STACKED_PARAMS if m + "." in name]
    return parts or [(name, None)]


# Tensors of quantization schemes Kiln refuses by their config: met without such a config.
_UNSERVED_QUANT_TENSORS = {
    ".input_scale": "a static activation scale", ".input_zero_point": "an activation zero point",
    ".weight_zero_point": "a weight zero point (asymmetric weights)",
    ".weight_g_idx": "a group index (group-wise weights)"}


def unexpected_tensor_message(name: str, hf_config) -> str:
    """Why a checkpoint tensor fits no parameter, with the config field most likely at fault."""
    hint = ""
    quant_tail = next((t for t in _UNSERVED_QUANT_TENSORS if name.endswith(t)), None)
    if quant_tail is not None:
        return (f"checkpoint tensor {name} is {_UNSERVED_QUANT_TENSORS[quant_tail]}, which "
                "Kiln does not serve (W8A8 int8 only: symmetric weights, dynamic per-token "
                "activations); its quantization_config should say so too (input_activations "
                "dynamic: false, or symmetric: false), else the checkpoint does not match it")
    if name.endswith(".bias"):
        field = "mlp_bias" if ".mlp." in name else "attention_bias"
        hint = f" (a bias, but the config has {field}={config_bias(hf_config, field)})"
    elif name.startswith("model.layers."):
        index = name.split(".")[2]
        # a layer the config has, holding a tensor no such layer has: no layer count is wrong
        hint = (f" (the config has num_hidden_layers={hf_config.num_hidden_layers})"
                if not index.isdigit() or int(index) >= hf_config.num_hidden_layers
                else f" (no {_model_kind(hf_config)} layer has such a tensor)")
    return (f"checkpoint tensor {name} matches no parameter of this "
            f"{_model_kind(hf_config)} model{hint}; the checkpoint "
            "does not match its config (config.json or the GGUF metadata); fix the config or "
            "use the checkpoint it came with")


def _model_kind(hf_config) -> str:
    """"Llama", "Qwen2", ...: the config class's name, or its model_type for a snapshot."""
    name = type(hf_config).__name__
    if name.endswith("Config"):
        return name.removesuffix("Config")
    return str(getattr(hf_config, "model_type", "") or "this")
