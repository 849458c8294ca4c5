"""Reading a compressed-tensors `quantization_config` (with the `compressed-tensors` package) and
accepting only the schemes Kiln runs: int8 W8A8 (symmetric per-channel weights, dynamic per-token
activations, format int-quantized or naive-quantized) and W4A16 (4-bit weights by group or
channel, format pack-quantized), either with an fp8 KV cache's per-tensor static scales
(kv_cache_scheme), or those scales alone; no config_groups at all (KV cache scales alone, sparsity
stored dense, or nothing) leaves the linears in the model dtype, as vLLM serves them.
Anything else is refused naming the field and its value.
"""
from typing import Any

from kiln.errors import ConfigError

# Formats that store W8A8 int8 as Kiln reads it (an int8 `weight` beside its `weight_scale`):
# compressed-tensors' int-quantized compressor is its naive-quantized one, and vLLM takes both.
INT8_FORMATS = ("int-quantized", "naive-quantized")
_FORMAT_WANTED = "needs format 'int-quantized' (or 'naive-quantized', stored the same way)"


class UnsupportedQuantization(ConfigError):
    """A quantization_config Kiln does not run; the message names the field and value."""


def _refuse(field: str, value: Any, want: str) -> None:
    raise UnsupportedQuantization(
        f"quantization_config.{field}={value!r} is not supported: Kiln serves compressed-tensors "
        f"W8A8 int8 (8-bit symmetric per-channel weights, dynamic per-token 8-bit symmetric "
        f"activations, format int-quantized) and W4A16 (4-bit weights, unquantized "
        f"activations, format pack-quantized); {want}")


def _check_args(field: str, args, strategy: str, dynamic: bool) -> None:
    if args is None:
        _refuse(field, None, "both weights and input_activations must be quantized "
                "(weight-only is 4-bit only: W8A16 is not supported)")
    checks = [("num_bits", args.num_bits, 8, "8 bits (4-bit only weight-only, as W4A16)"),
              ("type", str(args.type), "int", "integer quantization"),
              ("symmetric", args.symmetric, True, "symmetric (asymmetric zero points are not "
               "supported)"),
              ("dynamic", args.dynamic, dynamic, "dynamic activation scales (static ones are "
               "not supported)" if dynamic else "static weight scales"),
              ("strategy", str(args.strategy), strategy, f"strategy {strategy!r}")]
    for name, value, want, why in checks:
        if value != want:
            _refuse(f"{field}.{name}", value, f"needs {why}")
    if args.group_size not in (None, -1):
        _refuse(f"{field}.group_size", args.group_size, "group-wise scales are not supported")
    if args.block_structure is not None:
        _refuse(f"{field}.block_structure", args.block_structure, "block-wise scales are not "
                "supported")
    # `actorder` is not checked: the orders compressed-tensors still accepts ("weight",
    # "static") only changed the order GPTQ quantized columns in, and store a per-channel
    # weight the same; a checkpoint holding a g_idx is refused at load (a tensor Kiln lacks).


def _check_unread_sections(raw: dict) -> None:
    """Sections beside the quantization scheme that change what the weights mean, which the
    scheme's validation drops: an online rotation (transform_config, as QuIP and SpinQuant
    write) or sparse storage (sparsity_config). Run without them, such a checkpoint computes
    something else. Empty ones, as llm-compressor writes by default, are fine."""
    transform = raw.get("transform_config")
    if transform:
        _refuse("transform_config", transform, "rotations applied at run time (QuIP, "
                "SpinQuant) are not supported")
    sparsity = raw.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        _refuse("sparsity_config.format", sparsity["format"], "sparse weight storage is not "
                "supported (only 'dense')")


def check_kv_cache_scheme(scheme) -> None:
    """A kv_cache_scheme as vLLM runs it: static symmetric 8-bit float scales, one per layer's K
    and V (strategy 'tensor'; the checkpoint's k_scale / v_scale, read by the Attention layers
    and used under --kv-cache-dtype fp8). None: no KV cache scales."""
    if scheme is None:
        return
    checks = [("num_bits", scheme.num_bits, 8), ("type", str(scheme.type), "float"),
              ("strategy", str(scheme.strategy), "tensor"), ("dynamic", scheme.dynamic, False),
              ("symmetric", scheme.symmetric, True), ("group_size", scheme.group_size, None),
              ("block_structure", scheme.block_structure, None)]
    for name, value, want in checks:
        if value != want:
            # vLLM runs per-head scales on FlashAttention 3 (CUDA) only, not on its CPU backend
            per_head = (" (per-head K/V scales need attention kernels that take a scale per "
                        "head, which Kiln's do not)" if value == "attn_head" else "")
            raise UnsupportedQuantization(
                f"quantization_config.kv_cache_scheme.{name}={value!r} is not supported{per_head}"
                f": Kiln's fp8 KV cache takes static symmetric 8-bit float scales, one per layer "
                f"(num_bits 8, type 'float', strategy 'tensor', dynamic false, symmetric true); "
                f"needs {name} {want!r}, or a checkpoint without kv_cache_scheme")


def _validated(raw: dict):
    from compressed_tensors.quantization import QuantizationConfig
    from pydantic import ValidationError

    _check_unread_sections(raw)
    try:
        return QuantizationConfig.model_validate(raw)
    except (ValidationError, ValueError, KeyError) as e:
        raise UnsupportedQuantization(f"quantization_config is not a valid compressed-tensors "
                                      f"config: {e}") from None


def quantizes_no_linear(raw) -> bool:
    """Whether `raw` quantizes none of the linear layers: no config_groups (left out, null or
    empty). llm-compressor writes that for KV cache quantization alone (a kv_cache_scheme) and
    for a sparsified model stored dense (a sparsity_config alone); vLLM runs such linears
    unquantized (UnquantizedLinearMethod), in the model dtype."""
    if not isinstance(raw, dict):
        raw = raw.to_dict()
    return not raw.get("config_groups")


def parse_no_linear(raw: dict) -> str:
    """Validate a `raw` that quantizes no linear (quantizes_no_linear): its kv_cache_scheme as
    check_kv_cache_scheme takes it, and nothing beside it that changes the weights (sparse
    storage Kiln cannot read is refused naming sparsity_config.format). Returns the line to
    log: what is quantized, and that the linears run in the model dtype."""
    if not isinstance(raw, dict):
        raw = raw.to_dict()
    # left out or null: compressed-tensors' model requires the field
    scheme = _validated({**raw, "config_groups": {}}).kv_cache_scheme
    check_kv_cache_scheme(scheme)
    if scheme is not None:
        return ("compressed-tensors: only the KV cache is quantized (kv_cache_scheme, its "
                "per-layer scales); the linear layers run unquantized")
    sparsity = raw.get("sparsity_config") or {}
    what = (f"sparsity_config with structure {sparsity.get('sparsity_structure')!r} stored "
            f"{sparsity.get('format', 'dense')!r}" if sparsity else "nothing")
    return (f"compressed-tensors quantization_config quantizes no layer (no config_groups, no "
            f"kv_cache_scheme; {what}): the weights are served as stored, dense in the model "
            "dtype, as vLLM falls back to unquantized linears")


def is_weight_only_4bit(raw: dict) -> bool:
    """Whether every group of `raw` quantizes weights to 4 bits and leaves activations alone
    (W4A16, parse_w4a16's); any other scheme is W8A8's to accept or refuse."""
    if not isinstance(raw, dict):
        raw = raw.to_dict()
    groups = (raw.get("config_groups") or {}).values()
    return bool(groups) and all(isinstance(g, dict) and g.get("input_activations") is None
                                and (g.get("weights") or {}).get("num_bits") == 4
                                for g in groups)


def parse_w4a16(raw: dict) -> tuple[list[str], list[str], int, bool]:
    """Validate `raw` as W4A16 (format pack-quantized, int4 weights by group or channel,
    symmetric or not); returns its targets, ignore list, group size (-1: per channel) and
    whether it is symmetric. Groups must agree on the last two."""
    if not isinstance(raw, dict):
        raw = raw.to_dict()
    config = _validated(raw)
    check_kv_cache_scheme(config.kv_cache_scheme)
    top_format = raw.get("format")
    seen = set()
    for name, scheme in config.config_groups.items():
        where = f"config_groups.{name}"
        fmt = (raw["config_groups"].get(name) or {}).get("format") or top_format
        if fmt != "pack-quantized":
            field = f"{where}.format" if top_format in (None, "mixed-precision") else "format"
            _refuse(field, fmt, "4-bit weights need format 'pack-quantized'")
        w = scheme.weights
        strategy = str(w.strategy)
        for name_, value, ok, why in (
                ("type", str(w.type), str(w.type) == "int", "integer 4-bit weights"),
                ("strategy", strategy, strategy in ("group", "channel"),
                 "strategy 'group' or 'channel' for 4-bit weights"),
                ("dynamic", w.dynamic, not w.dynamic, "static weight scales"),
                ("block_structure", w.block_structure, w.block_structure is None,
                 "no block-wise scales")):
            if not ok:
                _refuse(f"{where}.weights.{name_}", value, f"needs {why}")
        if scheme.output_activations is not None:
            _refuse(f"{where}.output_activations", scheme.output_activations.model_dump(),
                    "output activations are not quantized")
        group = w.group_size if strategy == "group" else -1
        if group is None or (group != -1 and (group <= 0 or group % 8)):
            _refuse(f"{where}.weights.group_size", w.group_size, "needs a positive multiple "
                    "of 8")
        seen.add((group, bool(w.symmetric)))
    if len(seen) > 1:
        _refuse("config_groups", sorted(config.config_groups), "4-bit groups must share one "
                "group_size and symmetric setting")
    targets, ignore = _targets_and_ignore(config)
    group, symmetric = seen.pop()
    return targets, ignore, group, symmetric


def _targets_and_ignore(config) -> tuple[list[str], list[str]]:
    for name, scheme in config.config_groups.items():
        _check_targets(f"config_groups.{name}.targets", list(scheme.targets))
    targets = [t for s in config.config_groups.values() for t in s.targets]
    ignore = list(config.ignore or [])
    # the head as the checkpoint names it: lm_head, GPT-NeoX's embed_out
    if _targets_lm_head(targets) and not any(ignored(head, ignore)
                                             for head in ("lm_head", "embed_out")):
        _refuse("ignore", ignore, "the LM head stays in the model dtype: list 'lm_head' in "
                "ignore (llm-compressor does by default)")
    return targets, ignore


def parse_w8a8_int8(raw: dict) -> tuple[list[str], list[str]]:
    """Validate `raw` (config.json's quantization_config) as W8A8 int8; returns its targets
    and its `ignore` list (module names or `re:` patterns; those stay in the model dtype)."""
    if not isinstance(raw, dict):
        raw = raw.to_dict()
    config = _validated(raw)
    _refuse_packed_beyond_w4a16(raw)
    # Read from the raw dict: the package's model fills a missing one with "fakequant". None or
    # "mixed-precision" defers to each group's own format (as vLLM reads it), checked below.
    top_format = raw.get("format")
    if top_format not in (*INT8_FORMATS, None, "mixed-precision"):
        _refuse("format", top_format, _FORMAT_WANTED)
    groups = raw.get("config_groups") or {}
    check_kv_cache_scheme(config.kv_cache_scheme)
    if not config.config_groups:
        _refuse("config_groups", {}, "needs at least one group (or, for a KV cache scheme "
                "alone, a kv_cache_scheme)")
    for name, scheme in config.config_groups.items():
        where = f"config_groups.{name}"
        own = (groups.get(name) or {}).get("format")  # raw: the model may fill it in
        if own not in (*INT8_FORMATS, *((None,) if top_format in INT8_FORMATS else ())):
            _refuse(f"{where}.format", own, _FORMAT_WANTED)
        _check_args(f"{where}.weights", scheme.weights, "channel", False)
        _check_args(f"{where}.input_activations", scheme.input_activations, "token", True)
        if scheme.output_activations is not None:
            _refuse(f"{where}.output_activations", scheme.output_activations.model_dump(),
                    "output activations are not quantized")
    return _targets_and_ignore(config)


def _refuse_packed_beyond_w4a16(raw: dict) -> None:
    """A pack-quantized group one field away from W4A16 (is_weight_only_4bit sent it here) is
    refused naming that field: W8A16's weights.num_bits, W4A8's input_activations (a W8A8 one
    stored pack-quantized is refused naming its format, below)."""
    for name, group in (raw.get("config_groups") or {}).items():
        group = group or {}
        if (group.get("format") or raw.get("format")) != "pack-quantized":
            continue
        where = f"config_groups.{name}"
        bits = (group.get("weights") or {}).get("num_bits")
        acts = group.get("input_activations")
        if bits != 4 and acts is None:
            _refuse(f"{where}.weights.num_bits", bits, "pack-quantized weights run at 4 bits "
                    "only (W4A16); W8A16 is not supported")
        if bits == 4 and acts is not None:
            _refuse(f"{where}.input_activations", acts, "4-bit weights "
                    "run with unquantized activations (W4A16); W4A8 is not supported")


def _check_targets(field: str, targets: list[str]) -> None:
    """Kiln matches a group's targets against its linear layers only: 'Linear', a module name
    or an `re:` pattern. Another class name (Embedding, LlamaAttention: CamelCase, as
    compressed-tensors matches classes) would quantize modules Kiln keeps float, and no target
    at all quantizes nothing; either was refused only later, by a tensor's dtype."""
    if not targets:
        _refuse(field, targets, "needs at least one target ('Linear', a module name or an "
                "'re:' pattern)")
    for target in targets:
        if target != "Linear" and not target.startswith("re:") and target[:1].isupper():
            _refuse(field, targets, f"{target!r} names a module class; Kiln quantizes linear "
                    "layers only: target 'Linear', module names or 're:' patterns")


def _targets_lm_head(targets: list[str]) -> bool:
    from compressed_tensors.utils.match import match_name

    return any(t == "Linear" or match_name("lm_head", t) for t in targets)


def ignored(name: str, ignore: list[str]) -> bool:
    from compressed_tensors.utils.match import match_name

    return any(match_name(name, pattern) for pattern in ignore)


def is_quantized(module_name: str, shard_names: list[str], targets: list[str],
                 ignore: list[str]) -> bool:
    """Whether a Kiln linear (`module_name`, or for a merged one the checkpoint names of its
    shards) is stored quantized: targeted ("Linear", a name or an `re:` pattern) and not
    ignored. Shards that disagree are refused."""
    from compressed_tensors.utils.match import match_name

    names = shard_names or [module_name]
    targeted = {n: any(t == "Linear" or match_name(n, t) for t in targets) for n in names}
    skipped = {n: ignored(n, ignore) for n in names}
    flags = {n: targeted[n] and not skipped[n] for n in names}
    if len(set(flags.values())) > 1:
        # name the list that splits them: the targets, else the ignore list
        field, value = (("targets", targets) if len(set(targeted.values())) > 1
                        else ("ignore", ignore))
        _refuse(field, value, f"the parts of {module_name} ({', '.join(names)}) must all be "
                "quantized or all left unquantized: they run as one matmul")
    return next(iter(flags.values()))
