"""Model loading: build the architecture's class on the device and dtype, then fill its weights.

`get_model(kiln_config)` is the one entry point the worker uses.
"""
import contextlib

import torch
from torch import nn

from kiln.config import KilnConfig, set_current_kiln_config
from kiln.errors import ConfigError
from kiln.forward_context import ir_selection_turn
from kiln.logger import init_logger
from kiln.model.registry import get_model_class

logger = init_logger(__name__)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(kiln_config: KilnConfig) -> nn.Module:
    """The model with uninitialised weights, on the configured device and dtype."""
    from kiln import ir

    model_config = kiln_config.model_config
    pooler = model_config.pooler_config
    model_cls = get_model_class(model_config.architecture,
                                classify=pooler is not None and pooler.task == "classify")
    ir.apply(kiln_config.ir_selection)  # before the layers take their attention backend
    with set_current_kiln_config(kiln_config), _default_dtype(model_config.torch_dtype), \
            kiln_config.device_config.device_obj:
        return model_cls(kiln_config=kiln_config)


def load_weights_into(model: nn.Module, kiln_config: KilnConfig) -> None:
    try:
        _load_weights_into(model, kiln_config)
    except ConfigError as e:
        overrides = kiln_config.model_config.hf_overrides
        if not overrides:
            raise
        # the checkpoint fits its own config.json: the flag that changed it is the one to fix
        raise ConfigError(f"{e} (--hf-overrides changed {sorted(overrides)} of the model's "
                          "config: keys that change shapes, such as num_hidden_layers or "
                          "vocab_size, must match the checkpoint's weights)") from None


def _load_weights_into(model: nn.Module, kiln_config: KilnConfig) -> None:
    model_config = kiln_config.model_config
    load_format = kiln_config.load_config.load_format
    if load_format == "auto":
        load_format = model_config.load_format
    if load_format == "dummy":
        from kiln.model.loader.dummy_loader import init_dummy_weights
        init_dummy_weights(model, model_config.seed)
    elif load_format == "gguf":
        from kiln.model.loader.gguf_loader import load_gguf_weights
        if model_config.gguf_file is None:
            raise FileNotFoundError(f"load_format='gguf' but {model_config.model_path} is not a "
                                    ".gguf file or a directory holding exactly one")
        load_gguf_weights(model, model_config.gguf_file, model_config.hf_config)
    elif load_format == "safetensors":
        from kiln.model.loader.hf_loader import load_hf_weights
        load_hf_weights(model, model_config.model_path)
    else:
        raise ConfigError(f"load_format {load_format!r} is not supported; use safetensors, gguf "
                          "or dummy")


def get_model(kiln_config: KilnConfig) -> nn.Module:
    """Build, load and return the model in eval mode."""
    with ir_selection_turn(kiln_config.ir_selection):  # another engine's forward waits
        return _get_model(kiln_config, use_snapshot=True)


def _get_model(kiln_config: KilnConfig, use_snapshot: bool) -> nn.Module:
    from kiln.model.layers.cpu_gemm import prepack_for_cpu, release_dense_copies
    from kiln.model.layers.quantization import get_quant_config
    from kiln.model.loader import weight_snapshot
    from kiln.model.residual_rotation import apply_rotation

    quant_config = get_quant_config(kiln_config.model_config)  # refuses a bad scheme first
    model = build_model(kiln_config)
    with torch.no_grad():
        if quant_config is not None:
            quant_config.prepare(model)
        check = _load_or_restore(model, kiln_config, use_snapshot)
        # on the float weights, before they are quantized
        apply_rotation(model, kiln_config.model_config.quantization_rotation)
        if quant_config is not None:
            quant_config.quantize_loaded(model)
        prepack_for_cpu(model)
        if check is not None and not check.passed():  # checked while the weights were packed
            logger.warning("weight snapshot %s is damaged (CRC mismatch); loading the model "
                           "file", check.path)
            # Saved again once removed; one that stays (a read-only cache) would be
            # restored again, so this load leaves the snapshot alone.
            return _get_model(kiln_config, use_snapshot=weight_snapshot.discard(check.path))
        release_dense_copies(model)
    return model.eval()


def _load_or_restore(model: nn.Module, kiln_config: KilnConfig, use_snapshot: bool):
    """Fill the weights: from the snapshot of an earlier load where one is kept (returns its
    running CRC check), else from the checkpoint, saving a snapshot where one is kept;
    without `use_snapshot`, from the checkpoint alone."""
    from kiln.model.loader import weight_snapshot

    path = weight_snapshot.snapshot_path(kiln_config) if use_snapshot else None
    if path is not None:
        check = weight_snapshot.restore(model, path)
        if check is not None:
            return check
        attrs = weight_snapshot.primitive_attrs(model)
    load_weights_into(model, kiln_config)
    if path is not None:
        weight_snapshot.save(model, path, attrs)
    return None


__all__ = ["get_model", "build_model", "load_weights_into"]
