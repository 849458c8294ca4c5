"""Quantized serving: which method a model runs with (`quantization`, vLLM's name) and the config
that converts its linear layers: W8A8 int8 from a compressed-tensors checkpoint or online, W8A8
fp8 online (per-tensor `fp8` or per-channel `ptpc_fp8` weight scales), W4A16 4-bit weights from
a compressed-tensors (pack-quantized), GPTQ or AWQ checkpoint.

`resolve_quantization` decides from the flag and the checkpoint's `quantization_config`;
`get_quant_config` builds the method's config for a ModelConfig (None: unquantized linears, as
a compressed-tensors checkpoint without config_groups has: KV cache scales or sparsity alone).
"""
from kiln.errors import ConfigError
from kiln.logger import init_logger

logger = init_logger(__name__)

QUANTIZATION_METHODS = ("int8", "fp8", "ptpc_fp8", "compressed-tensors", "gptq", "awq")
ONLINE_METHODS = ("int8", "fp8", "ptpc_fp8")
CHECKPOINT_METHODS = ("compressed-tensors", "gptq", "awq")


def with_quantization_config_as_read(hf_config):
    """`hf_config` with its quantization config where, and as, every reader expects it, as vLLM
    reads it: a `compression_config` as its quantization_config (compressed-tensors checkpoints
    of mid-2024, llm-compressor's first releases, kept their scheme under that key; such a
    checkpoint loaded as a float one and failed at its first int8 tensor), and its quant_method
    lowercased ("Compressed-Tensors", "GPTQ": vLLM lowercases it; Kiln refused it). Unchanged
    where neither applies."""
    from kiln.config.hf_config_snapshot import HFConfigSnapshot, snapshot_of

    config = getattr(hf_config, "quantization_config", None)
    compression = getattr(hf_config, "compression_config", None)
    if config is None and compression is not None:
        logger.info("config.json's compression_config is read as its quantization_config (the "
                    "key compressed-tensors checkpoints used before)")
        config = compression
    elif config is None or not isinstance(config, dict):
        return hf_config  # none, or a transformers config object the checkpoint readers take
    method = config.get("quant_method")
    if isinstance(method, str) and method != method.lower():
        config = {**config, "quant_method": method.lower()}
    if config is getattr(hf_config, "quantization_config", None):
        return hf_config
    snapshot = hf_config if isinstance(hf_config, HFConfigSnapshot) else snapshot_of(hf_config)
    return HFConfigSnapshot({**snapshot.to_dict(), "quantization_config": config})


def checkpoint_quant_method(hf_config) -> str | None:
    """The checkpoint's `quantization_config.quant_method`, or None for a float checkpoint."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    return str(qc.get("quant_method"))


def resolve_quantization(requested: str | None, hf_config) -> str | None:
    """The method the model runs with: the checkpoint's, or `requested` (online) for a float one.
    A method Kiln lacks, or online quantization of a quantized checkpoint, is a ValueError
    naming the flag or field."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or "
                          f"unset), got {requested!r}")
    stored = checkpoint_quant_method(hf_config)
    if stored is not None:
        if stored not in CHECKPOINT_METHODS:
            raise ConfigError(f"quantization_config.quant_method={stored!r} is not supported; "
                              "Kiln serves compressed-tensors (W8A8 int8, W4A16), GPTQ and AWQ "
                              "4-bit checkpoints, or quantizes a float checkpoint on load "
                              "(--quantization int8, fp8 or ptpc_fp8)")
        if requested not in (None, stored):
            raise ConfigError(f"--quantization {requested} does not match this checkpoint: it "
                              f"is already quantized (quantization_config.quant_method="
                              f"{stored!r}); drop --quantization")
        return stored
    if requested in CHECKPOINT_METHODS:
        raise ConfigError(f"--quantization {requested} needs a checkpoint whose config.json "
                          f"has a quantization_config (quant_method {requested!r}); for a "
                          "float checkpoint use "
                          "--quantization int8 (or fp8, ptpc_fp8)")
    return requested


def _raw_config(hf_config) -> dict:
    qc = hf_config.quantization_config
    return qc if isinstance(qc, dict) else qc.to_dict()


def get_quant_config(model_config):
    """The quantization config of the model (None when unquantized); a scheme Kiln cannot run
    is refused here, before any weight is read."""
    from kiln.model.layers.quantization.w8a8_int8 import Int8W8A8Config

    method = model_config.quantization
    if method is None:
        return None
    if method == "int8":
        return Int8W8A8Config(online=True)
    if method in ("fp8", "ptpc_fp8"):
        from kiln.model.layers.quantization.fp8 import Fp8W8A8Config

        return Fp8W8A8Config(per_channel=method == "ptpc_fp8")
    from kiln.model.layers.quantization import compressed_tensors as ct
    from kiln.model.layers.quantization import int4_formats
    from kiln.model.layers.quantization.int4_weight import Int4WeightConfig

    raw = _raw_config(model_config.hf_config)
    if method == "compressed-tensors" and ct.quantizes_no_linear(raw):
        line = ct.parse_no_linear(raw)
        # vLLM warns for float linears under compressed-tensors: nothing to accelerate
        (logger.info if raw.get("kv_cache_scheme") else logger.warning)(line)
        return None
    if method == "gptq":
        group, symmetric = int4_formats.parse_gptq(raw)
        return Int4WeightConfig("gptq", group, symmetric)
    if method == "awq":
        group, skip = int4_formats.parse_awq(raw)
        return Int4WeightConfig("awq", group, False, skip=skip)
    if ct.is_weight_only_4bit(raw):
        targets, ignore, group, symmetric = ct.parse_w4a16(raw)
        return Int4WeightConfig("compressed-tensors", group, symmetric, targets, ignore)
    targets, ignore = ct.parse_w8a8_int8(raw)
    return Int8W8A8Config(online=False, targets=targets, ignore=ignore)
