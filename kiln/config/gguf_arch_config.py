"""HF configs of the GGUF architectures transformers does not convert (Gemma, Granite, OLMo-2 / 3,
SmolLM3, EXAONE-4, GLM-4, Seed-OSS, ERNIE-4.5: gguf_family_fields.py) or
converts leaving out what llama.cpp reads (Gemma-2 / 3: soft caps, attention scale, vocabulary
size, local rope base), built from a file's metadata as llama.cpp's converter wrote it, and what
transformers' Phi-3 conversion leaves out (the sliding window, the original context length,
longrope's factors).

The metadata read is kept in the tensor table (`metadata_keys`: gguf_metadata.py), so a start
parses no file for it; longrope's factors are read from their two small tensors.
"""
from pathlib import Path

from kiln.config import gguf_family_fields

# general.architecture -> transformers' config class (and the architecture Kiln serves it as)
OWN_CONFIG_ARCHITECTURES = {"gemma": ("GemmaConfig", "GemmaForCausalLM"),
                            "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
                            "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
                            "granite": ("GraniteConfig", "GraniteForCausalLM"),
                            "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
                            "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
                            "exaone4": ("Exaone4Config", "Exaone4ForCausalLM"),
                            "glm4": ("Glm4Config", "Glm4ForCausalLM"),
                            "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM"),
                            "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM")}
# an olmo2 file with a window (gguf_family_fields.is_olmo3)
_OLMO3 = ("Olmo3Config", "Olmo3ForCausalLM")
# Granite's multipliers as its converter renames them (written only when not 0)
_GRANITE_SCALES = {"attention.scale": "attention_multiplier",
                   "embedding_scale": "embedding_multiplier",
                   "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"}
# What llama.cpp reads of a Gemma-2 / 3 file (llama_model's hparams): the soft caps (Gemma-2's
# 50 / 30 where the file has none), the window, and the layers' kinds and local rope base it
# fixes per architecture: every 2nd (Gemma-2) / 6th (Gemma-3) layer global, sliding layers of
# Gemma-3 roped with base 10000 unscaled.
_GEMMA_SOFT_CAPS = {"gemma2": {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
                    "gemma3": {"final_logit_softcapping": None}}
_GEMMA_GLOBAL_EVERY = {"gemma2": 2, "gemma3": 6}
# llama.cpp scales attention by 1 / sqrt(hidden / heads) for the 27B models (their
# query_pre_attn_scalar), known by their layer count, and by 1 / sqrt(head_dim) otherwise
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_TOKEN_IDS = {"bos_token_id": "tokenizer.ggml.bos_token_id",
              "eos_token_id": "tokenizer.ggml.eos_token_id",
              "pad_token_id": "tokenizer.ggml.padding_token_id"}


def metadata_keys(arch: str | None) -> list[str]:
    """The metadata keys read here beyond gguf_checks' (kept in the tensor table)."""
    keys = [f"{arch}.{key}" for key in _GRANITE_SCALES] if arch == "granite" else []
    if arch in _GEMMA_SOFT_CAPS:
        keys += [f"{arch}.{key}" for key in _GEMMA_SOFT_CAPS[arch]]
        keys.append(f"{arch}.attention.sliding_window")
    if arch == "phi3":
        keys += [f"{arch}.attention.sliding_window", f"{arch}.rope.scaling.attn_factor",
                 f"{arch}.rope.scaling.original_context_length"]
    return keys + gguf_family_fields.metadata_keys(arch) + ["tokenizer.ggml.padding_token_id"]


def values(table: dict) -> dict:
    """The table's kept metadata as {key: value} (arrays as their length)."""
    return {key: entry.get("value", entry.get("count"))
            for key, entry in table["metadata"].items()}


def common_fields(table: dict) -> dict:
    """The config fields every llama-style architecture has, as llama.cpp reads the metadata: a
    missing rope base is 10000, a missing head_count_kv the head count, no `output` tensor a head
    tied to the embedding, a q bias tensor the attention's bias flag."""
    arch = table["architecture"]
    meta, names = values(table), {t["name"] for t in table["tensors"]}

    def key(name, default=None):
        return meta.get(f"{arch}.{name}", default)

    heads = key("attention.head_count")
    fields = dict(
        num_hidden_layers=key("block_count"),
        max_position_embeddings=key("context_length"), hidden_size=key("embedding_length"),
        intermediate_size=key("feed_forward_length"), num_attention_heads=heads,
        num_key_value_heads=key("attention.head_count_kv", heads),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        vocab_size=key("vocab_size", meta.get("tokenizer.ggml.tokens")),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names)
    fields.update({field: meta[k] for field, k in _TOKEN_IDS.items() if meta.get(k) is not None})
    return fields


def build_config(table: dict):
    """transformers' config for a file of one of OWN_CONFIG_ARCHITECTURES (common_fields, and
    each architecture's own)."""
    import transformers

    arch = table["architecture"]
    meta, names = values(table), {t["name"] for t in table["tensors"]}
    olmo3 = gguf_family_fields.is_olmo3(table, meta)
    cls_name, architecture = _OLMO3 if olmo3 else OWN_CONFIG_ARCHITECTURES[arch]

    def key(name, default=None):
        return meta.get(f"{arch}.{name}", default)

    fields = {"architectures": [architecture], **common_fields(table)}
    heads = fields["num_attention_heads"]
    if arch in gguf_family_fields.FAMILY_ARCHITECTURES or olmo3:
        own = gguf_family_fields.family_fields(table, fields, names, key)
        if "rope_parameters" in own:  # nested by layer kind: the base is in it
            fields.pop("rope_theta")
        # no padding token where the file names none (the class's default, GLM-4's 151329, lies
        # outside a smaller vocabulary)
        fields.update(own, pad_token_id=fields.get("pad_token_id"))
    elif arch == "gemma":
        fields.update(head_dim=key("attention.key_length", fields["hidden_size"] // heads),
                      hidden_act="gelu_pytorch_tanh")
    elif arch in _GEMMA_SOFT_CAPS:
        fields.update(_gemma_fields(arch, fields, key))
    elif arch == "granite":
        fields["mlp_bias"] = "blk.0.ffn_up.bias" in names
        head_dim = fields["hidden_size"] // heads
        # llama.cpp's defaults for what the file leaves out: 1 / sqrt(head_dim), else no scaling
        fields.update({field: float(key(name) or (head_dim ** -0.5 if name == "attention.scale"
                                                  else 1.0))
                       for name, field in _GRANITE_SCALES.items()})
    return getattr(transformers, cls_name)(**fields)


def _gemma_fields(arch: str, fields: dict, key) -> dict:
    """Gemma-2 / 3's config fields as llama.cpp reads their files (see _GEMMA_SOFT_CAPS)."""
    layers, heads = fields["num_hidden_layers"], fields["num_attention_heads"]
    head_dim = key("attention.key_length", fields["hidden_size"] // heads)
    window = key("attention.sliding_window", 4096 if arch == "gemma2" else None)
    every = _GEMMA_GLOBAL_EVERY[arch]
    # a Gemma-3 file without a window: llama.cpp attends and ropes every layer as a global one
    kinds = ["full_attention" if not window or (i + 1) % every == 0 else "sliding_attention"
             for i in range(layers)]
    out = dict(head_dim=head_dim, hidden_activation="gelu_pytorch_tanh", layer_types=kinds,
               sliding_window=int(window) if window else None,
               query_pre_attn_scalar=(fields["hidden_size"] // heads
                                      if layers == _GEMMA_27B_LAYERS[arch] else head_dim),
               **{field: key(field, default) for field, default in
                  _GEMMA_SOFT_CAPS[arch].items()})
    if arch == "gemma3":
        out["rope_local_base_freq"] = 10000.0
    return out


def complete_phi3(config, table: dict, gguf: Path) -> None:
    """Put into transformers' Phi-3 config what its conversion drops: the sliding window
    (0: none, how the converter marks Phi-4's), the original context length, and a 128k file's
    longrope scaling (rope_factors_long / rope_factors_short, the attention factor)."""
    meta = values(table)
    window = meta.get("phi3.attention.sliding_window")
    if window is not None:
        config.sliding_window = int(window) or None
    original = meta.get("phi3.rope.scaling.original_context_length")
    if original:
        config.original_max_position_embeddings = int(original)
    tensors = {t["name"]: t for t in table["tensors"]}
    if "rope_factors_long.weight" not in tensors:
        return
    from kiln.config.gguf_metadata import apply_rope_scaling
    from kiln.model.loader.gguf_loader import read_tensor

    scaling = {"rope_type": "longrope",
               "original_max_position_embeddings": int(original or config.max_position_embeddings)}
    long = [float(f) for f in read_tensor(gguf, tensors["rope_factors_long.weight"]).ravel()]
    short = tensors.get("rope_factors_short.weight")  # optional in llama.cpp: none is 1s
    scaling.update(long_factor=long, short_factor=[1.0] * len(long) if short is None else
                   [float(f) for f in read_tensor(gguf, short).ravel()])
    if meta.get("phi3.rope.scaling.attn_factor") is not None:
        scaling["attention_factor"] = float(meta["phi3.rope.scaling.attn_factor"])
    apply_rope_scaling(config, scaling)
