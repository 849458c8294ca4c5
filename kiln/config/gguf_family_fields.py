"""HF config fields of OLMo-3, SmolLM3, EXAONE-4, GLM-4, Seed-OSS and ERNIE-4.5 GGUF files, as
llama.cpp's converter writes them and its loader reads them back (gguf_arch_config builds the rest).

OLMo-3 has no architecture of its own: an `olmo2` file with a sliding window is one (the window's
layers from `attention.sliding_window_pattern`, one bool per layer, else every 4th layer global,
as llama.cpp). llama.cpp ropes OLMo-3's sliding layers with the file's base unscaled, its global
ones scaled; EXAONE-4 with a window ropes its sliding layers only; SmolLM3's every 4th layer is
NoPE (llama.cpp fixes it: no metadata says so); GLM-4 ropes `rope.dimension_count` of each head.
"""

# llama.cpp's fixed layouts where a file says nothing: every 4th layer global / NoPE
_EVERY = 4
WINDOW_ARCHITECTURES = ("olmo2", "exaone4")
# general.architecture of the families whose fields family_fields adds (OLMo-3's is olmo2)
FAMILY_ARCHITECTURES = ("smollm3", "exaone4", "glm4", "seed_oss", "ernie4_5")


def metadata_keys(arch: str | None) -> list[str]:
    """The metadata keys read here (kept in the tensor table)."""
    if arch in WINDOW_ARCHITECTURES:
        return [f"{arch}.attention.sliding_window", f"{arch}.attention.sliding_window_pattern"]
    return []


def is_olmo3(table: dict, meta: dict) -> bool:
    """An `olmo2` file converted from Olmo3ForCausalLM: the converter writes a window for it."""
    return table["architecture"] == "olmo2" and bool(meta.get("olmo2.attention.sliding_window"))


def window_layer_types(table: dict, num_layers: int) -> list[str] | None:
    """Each layer's kind from the file's window and pattern (True / a sliding layer, or an
    integer n: every n-th layer global), every 4th global without a pattern; None without a
    window."""
    arch, metadata = table["architecture"], table["metadata"]
    window = metadata.get(f"{arch}.attention.sliding_window", {}).get("value")
    if not window:
        return None
    entry = metadata.get(f"{arch}.attention.sliding_window_pattern") or {}
    if entry.get("values") is not None:
        sliding = [bool(v) for v in entry["values"]]
        if len(sliding) != num_layers:
            from kiln.errors import ConfigError

            raise ConfigError(f"GGUF metadata {arch}.attention.sliding_window_pattern has "
                              f"{len(sliding)} values for {num_layers} layers "
                              f"({arch}.block_count); the file is damaged or was not written "
                              "by a llama.cpp converter")
    else:
        every = entry.get("value") or _EVERY
        sliding = [(i + 1) % every != 0 for i in range(num_layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def family_fields(table: dict, fields: dict, names: set[str], key) -> dict:
    """The config fields of a file of one of these families beyond common_fields' (`fields`);
    `names`: the file's tensor names, `key(name)`: its `<arch>.<name>` metadata."""
    arch, layers = table["architecture"], fields["num_hidden_layers"]
    heads = fields["num_attention_heads"]
    head_dim = key("attention.key_length") or fields["hidden_size"] // heads
    own: dict = {"head_dim": head_dim}
    if arch == "olmo2":  # OLMo-3 (is_olmo3): both kinds roped from the file's one base
        kinds = window_layer_types(table, layers)
        theta = fields["rope_theta"]
        own.update(layer_types=kinds, sliding_window=int(key("attention.sliding_window")),
                   rope_parameters={kind: {"rope_type": "default", "rope_theta": theta}
                                    for kind in ("sliding_attention", "full_attention")})
        return own
    if arch == "smollm3":
        own.update(no_rope_layers=[int((i + 1) % _EVERY != 0) for i in range(layers)],
                   use_sliding_window=False, sliding_window=None)
        return own
    if arch == "exaone4":
        kinds = window_layer_types(table, layers)
        window = key("attention.sliding_window") if kinds else None
        own.update(sliding_window=int(window) if window else None,
                   layer_types=kinds or ["full_attention"] * layers)
        return own
    if arch == "glm4":
        rotary = key("rope.dimension_count") or head_dim // 2  # llama.cpp writes half a head
        own["partial_rotary_factor"] = rotary / head_dim
        return own
    if arch == "seed_oss":
        own.update(attention_out_bias="blk.0.attn_output.bias" in names,
                   mlp_bias="blk.0.ffn_up.bias" in names)
        return own
    if arch == "ernie4_5":
        own["use_bias"] = "blk.0.attn_q.bias" in names
        return own
    raise ValueError(arch)
