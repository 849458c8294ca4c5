"""Weights changed while the engine runs (vLLM's RL hooks: `load_weights`, `reload_weights`):
HF-named tensors written in place by the model's own weight loaders, then the packed copies redone.

In place, so every parameter keeps its tensor: compiled graphs take parameters and buffers as
inputs read off the layers on every call (Inductor freezes none), so they see the new values; a
layer's oneDNN-packed copy (kiln/model/layers/cpu_gemm.py) is derived from its weight and is
packed again for each weight that changed. Each rank's loaders take its own shard.
"""
import contextlib
from collections.abc import Iterable

import torch
from torch import nn

from kiln.errors import ConfigError


def update_refusal(model: nn.Module, model_config) -> str | None:
    """Why this model's weights cannot be replaced by HF-named tensors (None: they can). A
    checkpoint quantizing only its KV cache has float linears: those update."""
    if model_config.quant_kind is not None:
        return (f"the model is quantized (quantization={model_config.quantization!r}): its "
                f"layers hold {model_config.quant_kind} weights and scales derived at load, which "
                "HF-named float tensors cannot update; serve the unquantized checkpoint to update "
                "weights")
    for name, module in model.named_modules():
        if getattr(module, "cpu_blocks", None) is not None or \
                getattr(module, "table_blocks", None) is not None:
            return (f"{name} holds a GGUF file's quantized blocks, which HF-named tensors cannot "
                    "update; serve a safetensors checkpoint to update weights")
    for name, param in model.named_parameters():
        if param.is_meta:
            return f"{name} was let go at load (a GGUF model's dense copy); it cannot be updated"
    return None


def check_updatable(model: nn.Module, model_config, what: str) -> None:
    refusal = update_refusal(model, model_config)
    if refusal is not None:
        raise ConfigError(f"{what}: {refusal}")


@contextlib.contextmanager
def partial_load(model: nn.Module):
    """load_weights takes some of the weights, not all (an update brings a few)."""
    model.require_all_weights = False
    try:
        yield
    finally:
        del model.require_all_weights  # the class's default again


def changed_parameters(model: nn.Module, loaded: Iterable[str]) -> set[int]:
    """ids of the parameters behind load_weights' parts (`name` or `name#shard`)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return {id(params[part.split("#")[0]]) for part in loaded if part.split("#")[0] in params}


def load_in_place(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                  kiln_config) -> set[str]:
    """Write HF-named tensors into the model's parameters and re-pack what they changed;
    returns the parts loaded. A name that fits no parameter raises, naming it."""
    from kiln.forward_context import ir_selection_turn
    from kiln.model.layers.cpu_gemm import prepack_for_cpu

    if isinstance(weights, dict):
        weights = weights.items()
    with ir_selection_turn(kiln_config.ir_selection), torch.no_grad(), partial_load(model):
        try:
            loaded = model.load_weights(_checked(weights))
        except BaseException:
            # the tensors before the one that failed are written, and which those were is
            # unknown here: every packed copy is redone, or their layers would compute with
            # the old weights' (neither the old model nor the new)
            prepack_for_cpu(model)
            raise
        prepack_for_cpu(model, only=changed_parameters(model, loaded))
    return loaded


def reload_from_checkpoint(model: nn.Module, kiln_config) -> None:
    """Every weight read again from the engine's checkpoint (or its dummy weights)."""
    from kiln.forward_context import ir_selection_turn
    from kiln.model.layers.cpu_gemm import prepack_for_cpu
    from kiln.model.loader import load_weights_into

    with ir_selection_turn(kiln_config.ir_selection), torch.no_grad():
        load_weights_into(model, kiln_config)
        prepack_for_cpu(model)


def _checked(weights):
    for item in weights:
        if not (isinstance(item, (tuple, list)) and len(item) == 2
                and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)):
            raise ValueError("weights must be (name, tensor) pairs with HF checkpoint names, "
                             f"e.g. ('model.norm.weight', tensor); got {_describe(item)}")
        yield item[0], item[1]


def _describe(item) -> str:
    if isinstance(item, (tuple, list)):
        return f"({', '.join(type(x).__name__ for x in item)})"
    return type(item).__name__
