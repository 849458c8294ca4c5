"""Tiny EAGLE-1 heads the EAGLE tests write (config.json + model.safetensors in EAGLE's own
layout: fc, layers.0.*, a stored embed_tokens copy), and a plain-torch reference of one."""
import functools
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def target_weights(target_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(target_dir / "model.safetensors"))


def write_head(path: Path, target_dir: Path, *, seed: int = 0, mirror: bool = False,
               architecture: str = "EAGLELlamaForCausalLM", **overrides) -> Path:
    """A 1-layer head over target_dir's config. mirror: fc = [I | 0] (no bias) and the
    target's layer 0 (its input norm dropped), which drafts what a 1-layer target whose attention adds nothing
    picks next (make_bigram_target); else random weights."""
    config = json.loads((target_dir / "config.json").read_text())
    config.update(architectures=[architecture], num_hidden_layers=1, **overrides)
    h, v = config["hidden_size"], config["vocab_size"]
    src = target_weights(target_dir)
    gen = torch.Generator().manual_seed(seed)
    if mirror:
        tensors = {f"layers.0.{n}.weight": src[f"model.layers.0.{n}.weight"] for n in _LAYER}
        tensors["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    else:  # random, fc with a bias
        tensors = {f"layers.0.{n}.weight": 0.2 * torch.randn(
            src[f"model.layers.0.{n}.weight"].shape, generator=gen) for n in _LAYER}
        tensors["fc.weight"] = 0.2 * torch.randn(h, 2 * h, generator=gen)
        tensors["fc.bias"] = 0.2 * torch.randn(h, generator=gen)  # EAGLE's own heads have one
    tensors["layers.0.post_attention_layernorm.weight"] = \
        src["model.layers.0.post_attention_layernorm.weight"]
    tensors["embed_tokens.weight"] = torch.zeros(v, h)  # the target's copy: never read
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(path / "model.safetensors"))
    return path


def make_bigram_target(path: Path) -> Path:
    """A 1-layer tiny Llama whose attention adds nothing (o_proj 0) and whose final norm only
    scales (weight 1): its next token depends on the last token alone."""
    from checkpoints import make_tiny_checkpoint

    make_tiny_checkpoint(path, "llama", tie=False, seed=3, num_hidden_layers=1)
    weights = target_weights(path)
    weights["model.layers.0.self_attn.o_proj.weight"].zero_()
    weights["model.norm.weight"].fill_(1.0)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):  # x [T, heads, d]
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].double() * inv[None]  # [T, d/2]
    cos, sin = [torch.cat([f(ang)] * 2, -1).float()[:, None] for f in (torch.cos, torch.sin)]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def attention(x, w, cfg, prefix: str = "layers.0."):
    """A Llama layer's causal self-attention in plain torch: x [t, in] at positions 0..t-1."""
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta")
    t, d = x.shape[0], cfg["hidden_size"] // nh
    pos = torch.arange(t)
    q = _rope((x @ w[f"{prefix}self_attn.q_proj.weight"].T).view(t, nh, d), pos, theta)
    kk = _rope((x @ w[f"{prefix}self_attn.k_proj.weight"].T).view(t, nkv, d), pos, theta)
    v = (x @ w[f"{prefix}self_attn.v_proj.weight"].T).view(t, nkv, d)
    kk, v = (z.repeat_interleave(nh // nkv, 1) for z in (kk, v))
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), kk.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    return o.transpose(0, 1).reshape(t, nh * d) @ w[f"{prefix}self_attn.o_proj.weight"].T


def mlp_block(x, w, cfg, prefix: str = "layers.0."):
    """x + MLP(post_attention_layernorm(x)): a Llama layer's second half."""
    n = _rms(x, w[f"{prefix}post_attention_layernorm.weight"], cfg["rms_norm_eps"])
    g = torch.nn.functional.silu(n @ w[f"{prefix}mlp.gate_proj.weight"].T) * \
        (n @ w[f"{prefix}mlp.up_proj.weight"].T)
    return x + g @ w[f"{prefix}mlp.down_proj.weight"].T


@functools.cache
def _hf_model(target_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def reference_drafts(head_dir: Path, target_dir: Path, tokens: list[int], k: int) -> list[int]:
    """EAGLE-1's k greedy drafts after `tokens` (the last one just sampled), from HF's target
    hidden states (its final-norm output) and the head run in plain torch."""
    cfg = json.loads((head_dir / "config.json").read_text())
    w = load_file(str(head_dir / "model.safetensors"))
    target = _hf_model(target_dir)
    with torch.no_grad():
        hidden = target.model(torch.tensor([tokens])).last_hidden_state[0]  # [n, H]
        embed, lm_head = target.model.embed_tokens.weight, target.lm_head.weight
        ids, states, drafts = list(tokens[1:]), list(hidden[:-1]), []
        for _ in range(k):
            x = torch.cat([embed[torch.tensor(ids)], torch.stack(states)], -1) @ w["fc.weight"].T
            x = x + w.get("fc.bias", 0)
            out = mlp_block(x + attention(x, w, cfg), w, cfg)  # [t, H]
            drafts.append(int((out[-1] @ lm_head.T).argmax()))
            ids.append(drafts[-1])
            states.append(out[-1])
    return drafts
