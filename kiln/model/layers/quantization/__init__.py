"""Quantized serving: which method a model runs with (`quantization`, vLLM's name) and the config
that converts its linear layers: W8A8 int8 from a compressed-tensors checkpoint or online, W8A8
fp8 online (per-tensor `fp8` or per-channel `ptpc_fp8` weight scales).

`resolve_quantization` decides from the flag and the checkpoint's `quantization_config`;
`get_quant_config` builds the method's config for a ModelConfig (None: unquantized).
"""
from kiln.errors import ConfigError

QUANTIZATION_METHODS = ("int8", "fp8", "ptpc_fp8", "compressed-tensors")
ONLINE_METHODS = ("int8", "fp8", "ptpc_fp8")


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
        if stored != "compressed-tensors":
            raise ConfigError(f"quantization_config.quant_method={stored!r} is not supported; "
                              "Kiln serves compressed-tensors W8A8 int8 checkpoints, or "
                              "quantizes a float checkpoint on load (--quantization int8, fp8 or "
                              "ptpc_fp8)")
        if requested not in (None, "compressed-tensors"):
            raise ConfigError(f"--quantization {requested} quantizes a float checkpoint, but this "
                              "one is already quantized (quantization_config.quant_method="
                              "'compressed-tensors'); drop --quantization")
        return stored
    if requested == "compressed-tensors":
        raise ConfigError("--quantization compressed-tensors needs a checkpoint whose config.json "
                          "has a quantization_config; for a float checkpoint use --quantization "
                          "int8 (or fp8, ptpc_fp8)")
    return requested


def get_quant_config(model_config):
    """The W8A8 config of the model (None when unquantized); a compressed-tensors scheme Kiln
    cannot run is refused here, before any weight is read."""
    from kiln.model.layers.quantization.w8a8_int8 import Int8W8A8Config

    method = model_config.quantization
    if method is None:
        return None
    if method == "int8":
        return Int8W8A8Config(online=True)
    if method in ("fp8", "ptpc_fp8"):
        from kiln.model.layers.quantization.fp8 import Fp8W8A8Config

        return Fp8W8A8Config(per_channel=method == "ptpc_fp8")
    from kiln.model.layers.quantization.compressed_tensors import parse_w8a8_int8

    targets, ignore = parse_w8a8_int8(model_config.hf_config.quantization_config)
    return Int8W8A8Config(online=False, targets=targets, ignore=ignore)
