"""HF configs of the GGUF architectures transformers does not convert (Gemma, Granite, OLMo-2),
built from a file's metadata as llama.cpp's converter wrote it, and what transformers' Phi-3
conversion leaves out (the sliding window, the original context length, longrope's factors).

The metadata read is kept in the tensor table (`metadata_keys`: gguf_metadata.py), so a start
parses no file for it; longrope's factors are read from their two small tensors.
"""
from pathlib import Path

# general.architecture -> transformers' config class (and the architecture Kiln serves it as)
OWN_CONFIG_ARCHITECTURES = {"gemma": ("GemmaConfig", "GemmaForCausalLM"),
                            "granite": ("GraniteConfig", "GraniteForCausalLM"),
                            "olmo2": ("Olmo2Config", "Olmo2ForCausalLM")}
# Granite's multipliers as its converter renames them (written only when not 0)
_GRANITE_SCALES = {"attention.scale": "attention_multiplier",
                   "embedding_scale": "embedding_multiplier",
                   "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"}
_TOKEN_IDS = {"bos_token_id": "tokenizer.ggml.bos_token_id",
              "eos_token_id": "tokenizer.ggml.eos_token_id",
              "pad_token_id": "tokenizer.ggml.padding_token_id"}


def metadata_keys(arch: str | None) -> list[str]:
    """The metadata keys read here beyond gguf_checks' (kept in the tensor table)."""
    keys = [f"{arch}.{key}" for key in _GRANITE_SCALES] if arch == "granite" else []
    if arch == "phi3":
        keys += [f"{arch}.attention.sliding_window", f"{arch}.rope.scaling.attn_factor",
                 f"{arch}.rope.scaling.original_context_length"]
    return keys + ["tokenizer.ggml.padding_token_id"]


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
    cls_name, architecture = OWN_CONFIG_ARCHITECTURES[arch]

    def key(name, default=None):
        return meta.get(f"{arch}.{name}", default)

    fields = {"architectures": [architecture], **common_fields(table)}
    heads = fields["num_attention_heads"]
    if arch == "gemma":
        fields.update(head_dim=key("attention.key_length", fields["hidden_size"] // heads),
                      hidden_act="gelu_pytorch_tanh")
    elif arch == "granite":
        fields["mlp_bias"] = "blk.0.ffn_up.bias" in names
        head_dim = fields["hidden_size"] // heads
        # llama.cpp's defaults for what the file leaves out: 1 / sqrt(head_dim), else no scaling
        fields.update({field: float(key(name) or (head_dim ** -0.5 if name == "attention.scale"
                                                  else 1.0))
                       for name, field in _GRANITE_SCALES.items()})
    return getattr(transformers, cls_name)(**fields)


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
