"""Reading a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) into
per-module (A, B) pairs, refusing what Kiln cannot apply by the field that asks for it.

Kiln applies LoRA to the decoder layers' q/k/v/o and gate/up/down projections (Phi-3's fused
qkv_proj / gate_up_proj adapters are split into those parts; Phi-1/2's q/k/v, dense, fc1 / fc2);
embedding and lm_head LoRA, modules_to_save, DoRA and LoRA biases are refused.
"""
import json
import math
import os
import re
from dataclasses import dataclass

import torch

from kiln.errors import ConfigError

# PEFT module name -> (Kiln's fused layer, slice index in it)
TARGETS = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
# Phi-1 / 1.5 / 2 (model_type "phi"): its checkpoint's module names, on Kiln's layers (phi.py)
PHI_TARGETS = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2), "dense": ("self_attn.o_proj", 0),
    "fc1": ("mlp.c_fc", 0), "fc2": ("mlp.c_proj", 0),
}
# model_type -> its PEFT modules, where they are not Llama's
_FAMILY_TARGETS = {"phi": PHI_TARGETS}
# Every family's PEFT module -> Kiln layer (the families agree where they share a name)
ALL_TARGETS = {**TARGETS, **PHI_TARGETS}
# A fused projection's PEFT module (Phi-3's checkpoint names, so its adapters') -> its parts,
# in row order: one A serves them all and B's rows split, B @ A's rows being each part's.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def targets_for(hf_config) -> dict[str, tuple[str, int]]:
    """The PEFT modules an adapter of this model may target -> (Kiln's layer, slice in it)."""
    return _FAMILY_TARGETS.get(getattr(hf_config, "model_type", None), TARGETS)


def _fused_for(hf_config) -> dict[str, tuple[str, ...]]:
    """The fused PEFT modules of this model's checkpoints: Llama-style ones' (Phi's has none:
    HF's Phi holds no qkv_proj, so no adapter of it names one)."""
    return {} if getattr(hf_config, "model_type", None) in _FAMILY_TARGETS else FUSED
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\."
                  r"lora_(A|B)(?:\.[\w-]+)?\.weight$")
_UNSUPPORTED_TARGETS = ("embed_tokens", "lm_head")


@dataclass
class LoRAAdapter:
    """One adapter, on the host: weights[(layer, peft_module)] = (A [r, in], B [out, r] * scale)."""
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _config(path: str) -> dict:
    file = os.path.join(path, "adapter_config.json")
    if not os.path.isdir(path):
        raise ConfigError(f"LoRA adapter path {path!r} is not a directory (a PEFT adapter "
                          "directory with adapter_config.json and adapter_model.safetensors)")
    if not os.path.isfile(file):
        raise ConfigError(f"LoRA adapter {path!r} has no adapter_config.json")
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"LoRA adapter {file}: unreadable JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"LoRA adapter {file} is not a JSON object")
    return config


def check_config(config: dict, where: str, max_lora_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a PEFT LoraConfig dict; what Kiln does not apply is refused."""
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ConfigError(f"{where}: peft_type {peft_type!r} is not supported; only LORA")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"{where}: r must be an int >= 1, got {rank!r}")
    if rank > max_lora_rank:
        raise ConfigError(f"{where}: r={rank} is above --max-lora-rank ({max_lora_rank}); "
                          f"raise --max-lora-rank to at least {rank}")
    alpha = config.get("lora_alpha", 8)
    # json reads Infinity and NaN: such a scale turns every output of the adapter to NaN
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ConfigError(f"{where}: lora_alpha must be a finite number, got {alpha!r}")
    if config.get("use_dora"):
        raise ConfigError(f"{where}: use_dora is true; DoRA adapters are not supported")
    if config.get("modules_to_save"):
        raise ConfigError(f"{where}: modules_to_save {config['modules_to_save']!r} is not "
                          "supported (fully trained modules beside the adapter)")
    if config.get("bias", "none") not in ("none", None):
        raise ConfigError(f"{where}: bias {config['bias']!r} is not supported; only 'none'")
    if config.get("fan_in_fan_out"):
        raise ConfigError(f"{where}: fan_in_fan_out is true; only Linear (out, in) weights "
                          "are supported")
    for field in ("rank_pattern", "alpha_pattern"):
        if config.get(field):
            raise ConfigError(f"{where}: {field} is not supported (one r and lora_alpha for "
                              "every module)")
    targets = config.get("target_modules") or []
    names = [targets] if isinstance(targets, str) else targets
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{where}: target_modules must be a module name or a list of them "
                          f"(strings), got {targets!r}")
    for bad in _UNSUPPORTED_TARGETS:
        if any(n == bad or n.endswith("." + bad) for n in names):
            raise ConfigError(f"{where}: target_modules holds {bad!r}; LoRA on embeddings and "
                              "lm_head is not supported (only q/k/v/o/gate/up/down projections)")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def expected_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """PEFT module -> (in_features, out_features) of the base model's projection."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
              "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}
    # Phi's names of the output projection and the non-gated MLP's up / down
    shapes.update(dense=shapes["o_proj"], fc1=shapes["up_proj"], fc2=shapes["down_proj"])
    return shapes


def load_adapter(path: str, hf_config, max_lora_rank: int,
                 dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """Read and check one adapter against the base model's config (shapes, layer count)."""
    from safetensors.torch import load_file

    path = os.path.expanduser(path)  # vLLM's get_adapter_absolute_path expands `~` too
    config = _config(path)
    where = f"LoRA adapter {path!r} (adapter_config.json)"
    rank, scaling = check_config(config, where, max_lora_rank)
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        extra = " (adapter_model.bin is a pickle, which Kiln does not load)" if os.path.isfile(
            os.path.join(path, "adapter_model.bin")) else ""
        raise ConfigError(f"LoRA adapter {path!r} has no adapter_model.safetensors{extra}")
    try:
        tensors = load_file(file)
    except Exception as e:  # a damaged file is the adapter's fault, not the engine's
        raise ConfigError(f"LoRA adapter {file}: unreadable safetensors ({e})") from None
    shapes = expected_shapes(hf_config)
    targets, fused = targets_for(hf_config), _fused_for(hf_config)
    num_layers = hf_config.num_hidden_layers
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if "lora_magnitude_vector" in key:
            raise ConfigError(f"LoRA adapter {file}: {key} is a DoRA magnitude (use_dora); "
                              "DoRA adapters are not supported")
        if "lora_embedding" in key or any(f".{t}." in key for t in _UNSUPPORTED_TARGETS):
            raise ConfigError(f"LoRA adapter {file}: {key}: LoRA on embeddings and lm_head is "
                              "not supported (only q/k/v/o/gate/up/down projections)")
        match = _KEY.match(key)
        if match is None or match.group(3) not in targets and match.group(3) not in fused:
            names = "/".join([*targets, *fused])
            model = getattr(hf_config, "model_type", None) or "this model"
            raise ConfigError(f"LoRA adapter {file}: tensor {key} is not a LoRA A/B weight of "
                              f"one of {model}'s {names} projections (modules_to_save, biases "
                              "and other modules are not supported)")
        layer, module, half = int(match.group(1)), match.group(3), match.group(4)
        if layer >= num_layers:
            raise ConfigError(f"LoRA adapter {file}: tensor {key} is for layer {layer}; the "
                              f"base model has {num_layers} layers")
        halves.setdefault((layer, module), {})[half] = tensor
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        name = f"model.layers.{layer}...{module}"
        if set(pair) != {"A", "B"}:
            raise ConfigError(f"LoRA adapter {file}: {name} has lora_{next(iter(pair))} "
                              "without its other half")
        a, b = pair["A"], pair["B"]
        parts = fused.get(module, (module,))
        fan_in, fan_outs = shapes[parts[0]][0], [shapes[part][1] for part in parts]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (sum(fan_outs), rank):
            raise ConfigError(f"LoRA adapter {file}: {name} has lora_A {tuple(a.shape)} and "
                              f"lora_B {tuple(b.shape)}; r={rank} on this base model needs "
                              f"{(rank, fan_in)} and {(sum(fan_outs), rank)}")
        for part, b_rows in zip(parts, b.split(fan_outs)):  # [fan_out, r] each
            if (layer, part) in weights:  # qkv_proj beside q_proj: which one is meant?
                raise ConfigError(f"LoRA adapter {file}: layer {layer} has {part} twice (as "
                                  f"itself and in {' / '.join(m for m in fused if part in fused[m])})")
            weights[(layer, part)] = (a.to(dtype), (b_rows.to(torch.float32) * scaling).to(dtype))
    if not weights:
        raise ConfigError(f"LoRA adapter {file} holds no LoRA weights")
    return LoRAAdapter(rank=rank, scaling=scaling, weights=weights)
