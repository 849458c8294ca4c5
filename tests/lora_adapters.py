"""PEFT LoRA adapters written by hand (random A, nonzero B) for tiny checkpoints, and the
checkpoint with an adapter merged in (W + scale * B @ A): HF transformers' oracle for LoRA."""
import json
import math
from pathlib import Path

import torch

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# Phi-3's fused projections (its PEFT adapters target these instead of q/k/v and gate/up)
FUSED_MODULES = {"qkv_proj": "self_attn", "gate_up_proj": "mlp"}
# Phi-1/2's output projection and non-gated MLP
PHI_MODULES = {"dense": "self_attn", "fc1": "mlp", "fc2": "mlp"}
PHI_TARGETS = ("q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2")


def write_adapter(path: Path, base_dir: Path, *, rank: int = 4, alpha: int = 8, seed: int = 1,
                  targets=tuple(MODULES), use_rslora: bool = False, **config_extra) -> Path:
    from safetensors.torch import save_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(base_dir)
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    kv = cfg.num_key_value_heads
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv * head_dim),
              "v_proj": (hidden, kv * head_dim), "o_proj": (heads * head_dim, hidden),
              "gate_proj": (hidden, cfg.intermediate_size),
              "up_proj": (hidden, cfg.intermediate_size),
              "down_proj": (cfg.intermediate_size, hidden)}
    shapes["qkv_proj"] = (hidden, (heads + 2 * kv) * head_dim)
    shapes["gate_up_proj"] = (hidden, 2 * cfg.intermediate_size)
    shapes.update(dense=shapes["o_proj"], fc1=shapes["up_proj"], fc2=shapes["down_proj"])
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for module in targets:
            fan_in, fan_out = shapes[module]
            parent = {**MODULES, **FUSED_MODULES, **PHI_MODULES}[module]
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.2
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.2
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha,
              "target_modules": list(targets), "use_rslora": use_rslora, "bias": "none",
              "base_model_name_or_path": str(base_dir), "task_type": "CAUSAL_LM",
              **config_extra}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def merged_model(base_dir: Path, adapter_dir: Path):
    """HF transformers' model of the base checkpoint with the adapter merged into its weights
    (W + scale * B @ A, as PEFT's merge does), in memory."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    rank, alpha = config["r"], config["lora_alpha"]
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            params[name] += scale * (b @ a)
    return model


def greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF's greedy continuation of each prompt, EOS ignored (checkpoints.hf_greedy's, given
    the model)."""
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for ids in prompts:
            y = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                               do_sample=False, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


def token_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """HF's logprob of each of `tokens` continuing `prompt`."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    lp = logits.log_softmax(-1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]
