"""Tiny random EAGLE-3 heads the EAGLE-3 tests write (config.json + model.safetensors in EAGLE-3's
own layout: fc over 3 target layers, midlayer.* with a 2H-wide attention input, norm, lm_head over
a draft vocabulary with d2t / t2d), and a plain-torch reference of one fed HF's hidden states."""
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .eagle_heads import _hf_model, _rms, attention, mlp_block

_NORMS = ("input_layernorm", "hidden_norm", "post_attention_layernorm")


def write_eagle3_head(path: Path, target_dir: Path, *, seed: int = 0, draft_vocab: int | None = None,
                      aux_ids=(2, 0, 1), yuhuili: bool = True, own_embed: bool = False,
                      own_lm_head: bool = True, d2t: bool = True, width: int | None = None,
                      **overrides) -> Path:
    """A 1-layer random head over target_dir's config. draft_vocab: its vocabulary, a random
    subset of the target's (d2t maps it); yuhuili: names as yuhuili's checkpoints (midlayer.*,
    no model.), else model.layers.0.*; own_embed / own_lm_head: store them (else the target's
    are read); width: the head's own hidden_size, the target's in target_hidden_size."""
    config = json.loads((target_dir / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLMEagle3" if yuhuili
                                 else "Eagle3LlamaForCausalLM"], num_hidden_layers=1)
    if aux_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = list(aux_ids)
    th, v = config["hidden_size"], config["vocab_size"]
    if width is not None:
        config.update(hidden_size=width, target_hidden_size=th,
                      head_dim=width // config["num_attention_heads"])
    h, dv = config["hidden_size"], draft_vocab or v
    if draft_vocab is not None:
        config["draft_vocab_size"] = dv
    config.update(overrides)
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.2):
        return scale * torch.randn(*shape, generator=gen)

    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]
    layer = {"self_attn.q_proj.weight": rand(h, 2 * h), "self_attn.k_proj.weight": rand(kv, 2 * h),
             "self_attn.v_proj.weight": rand(kv, 2 * h), "self_attn.o_proj.weight": rand(h, h)}
    inter = config["intermediate_size"]
    for name, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)),
                        ("down_proj", (h, inter))):
        layer[f"mlp.{name}.weight"] = rand(*shape)
    for name in _NORMS:
        layer[f"{name}.weight"] = 1 + rand(h, scale=0.1)
    prefix = "midlayer." if yuhuili else "model.layers.0."
    tensors = {prefix + n: t for n, t in layer.items()}
    top = "" if yuhuili else "model."
    tensors[f"{top}fc.weight"] = rand(h, 3 * th)
    tensors[f"{top}norm.weight"] = 1 + rand(h, scale=0.1)
    if own_embed:
        tensors[f"{top}embed_tokens.weight"] = rand(v, h, scale=1.0)
    if own_lm_head:
        tensors["lm_head.weight"] = rand(dv, h, scale=1.0)
    if d2t:
        ids = torch.randperm(v, generator=gen)[:dv].sort().values
        tensors["d2t"] = ids - torch.arange(dv)
        tensors["t2d"] = torch.zeros(v, dtype=torch.bool).index_fill_(0, ids, True)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(path / "model.safetensors"))
    return path


def _target_states(target_dir: Path, tokens: list[int], layer_ids) -> torch.Tensor:
    """HF's hidden states at the input of each of `layer_ids` (num_layers: the last layer's
    output before the final norm), concatenated in layer order: [n, len * H]."""
    target = _hf_model(target_dir)
    last = {}
    hook = target.model.layers[-1].register_forward_hook(
        lambda m, i, o: last.setdefault("out", o[0] if isinstance(o, tuple) else o))
    try:
        states = target.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    num_layers = len(target.model.layers)
    picked = [last["out"] if i == num_layers else states[i] for i in sorted(set(layer_ids))]
    return torch.cat(picked, -1)[0]


def reference_eagle3_drafts(head_dir: Path, target_dir: Path, tokens: list[int],
                            k: int) -> list[int]:
    """EAGLE-3's k greedy drafts (target ids) after `tokens` (the last one just sampled)."""
    cfg = json.loads((head_dir / "config.json").read_text())
    w = {n.removeprefix("model.").replace("midlayer.", "layers.0."): t
         for n, t in load_file(str(head_dir / "model.safetensors")).items()}
    target, eps = _hf_model(target_dir), cfg["rms_norm_eps"]
    with torch.no_grad():
        aux = _target_states(target_dir, tokens, cfg["eagle_aux_hidden_state_layer_ids"])
        embed = w.get("embed_tokens.weight", target.model.embed_tokens.weight)
        lm_head = w.get("lm_head.weight", target.lm_head.weight)
        d2t = w.get("d2t", torch.zeros(lm_head.shape[0], dtype=torch.int64))
        ids, drafts = list(tokens[1:]), []
        states = list(aux[:-1] @ w["fc.weight"].T)  # [H] each
        for _ in range(k):
            h = torch.stack(states)
            normed = _rms(h, w["layers.0.hidden_norm.weight"], eps)
            e = _rms(embed[torch.tensor(ids)], w["layers.0.input_layernorm.weight"], eps)
            residual = normed if cfg.get("norm_before_residual") else h
            x = residual + attention(torch.cat([e, normed], -1), w, cfg)
            out = mlp_block(x, w, cfg)  # [t, H] pre-norm
            d = int((_rms(out[-1], w["norm.weight"], eps) @ lm_head.T).argmax())
            drafts.append(d + int(d2t[d]))
            ids.append(drafts[-1])
            states.append(out[-1])
    return drafts
