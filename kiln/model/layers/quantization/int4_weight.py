"""W4A16 linear layers: 4-bit weights with group-wise float scales (and zero points), activations in
the model dtype, read from compressed-tensors pack-quantized, GPTQ or AWQ checkpoints.

`Int4WeightConfig.prepare(model)` gives each quantized linear parameters named as its format
stores them, whose loaders convert to Kiln's canonical int4 layout (kiln/ir/int4.py);
`quantize_loaded` then, where the native GGUF kernel runs, turns each into Q4_1 kernel blocks
once (the layer calls gguf_linear on them), else the layer runs the IR op int4_weight_linear.
"""
from dataclasses import dataclass, field

import torch
from torch import nn

from kiln import ir
from kiln.errors import ConfigError
from kiln.ir import int4
from kiln.logger import init_logger
from kiln.model.layers import cpu_gemm
from kiln.model.layers.fused_moe import FusedMoE
from kiln.model.layers.linear import LinearBase
from kiln.model.layers.quantization import int4_formats
from kiln.native import build, gguf_matmul

logger = init_logger(__name__)

_SHARD_INDEX = {"q": 0, "k": 1, "v": 2, None: 0}


class Int4LinearMethod:
    """How a layer left in the canonical layout computes: the IR op on it."""

    def __init__(self, group_size: int):
        self.group_size = group_size

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return ir.int4_weight_linear(x, layer.weight_packed, layer.weight_scale,
                                     layer.weight_zero_point, self.group_size, bias)


def _full_rows(layer: LinearBase, shard_id) -> int:
    """Output rows of the checkpoint tensor a shard loads from (before tensor parallelism)."""
    if shard_id in ("q", "k", "v"):
        return layer.q_size if shard_id == "q" else layer.kv_size
    if shard_id is not None:
        return layer.output_sizes[shard_id]
    return layer.output_size


def _param(tensor: torch.Tensor, loader) -> nn.Parameter:
    p = nn.Parameter(tensor, requires_grad=False)
    p.weight_loader = loader
    return p


def _converting_loader(layer: LinearBase, convert):
    def load(param, loaded: torch.Tensor, shard_id=None) -> None:
        canonical = convert(loaded, _full_rows(layer, shard_id))
        if shard_id is None:
            layer.weight_loader(param, canonical)
        else:
            layer.weight_loader(param, canonical, shard_id)
    return load


@dataclass
class Int4WeightConfig:
    fmt: str  # a key of int4_formats.FORMATS
    group_size: int  # -1: one group per row (per channel)
    symmetric: bool  # compressed-tensors without a zero point tensor
    targets: list[str] = field(default_factory=lambda: ["Linear"])
    ignore: list[str] = field(default_factory=list)  # compressed-tensors' ignore list
    skip: list[str] = field(default_factory=list)  # AWQ's modules_to_not_convert

    def layers(self, model: nn.Module) -> list[tuple[str, LinearBase]]:
        if any(isinstance(m, FusedMoE) for m in model.modules()):
            raise ConfigError("4-bit weight-only quantization of MoE experts is not supported "
                              f"(quantization_config of a {self.fmt} checkpoint); use a W8A8 "
                              "int8 checkpoint or a float one")
        if self.fmt == "compressed-tensors":
            from kiln.model.layers.quantization.w8a8_int8 import Int8W8A8Config

            return Int8W8A8Config(online=False, targets=self.targets,
                                  ignore=self.ignore).layers(model)
        return [(name, m) for name, m in model.named_modules()
                if isinstance(m, LinearBase) and getattr(m, "online_quantization", True)
                and not self._skipped(model, name)]

    def _skipped(self, model: nn.Module, name: str) -> bool:
        """AWQ's modules_to_not_convert (names contained in a module's, as AutoAWQ and vLLM
        match them), over a merged linear's parts as the checkpoint names them (Phi-3 stores
        qkv_proj / gate_up_proj fused: one name); parts that disagree are refused."""
        from kiln.model.layers.quantization.w8a8_int8 import MERGED_PARTS, checkpoint_module_name

        stored = checkpoint_module_name(model, name)
        prefix, _, leaf = stored.rpartition(".")
        fused = getattr(model, "fused_checkpoint_modules", ())
        names = [] if leaf in fused else [f"{prefix}.{p}" for p in MERGED_PARTS.get(leaf, ())]
        names = names or [stored]
        flags = {any(s in n for s in self.skip) for n in names}
        if len(flags) > 1:
            int4_formats.refuse("modules_to_not_convert", self.skip,
                                f"the parts of {name} run as one matmul: list all or none")
        return flags.pop()

    def _group(self, name: str, layer: LinearBase) -> int:
        """The layer's group size, refusing one its input width does not split into."""
        if layer.tp_size > 1:
            raise ConfigError("4-bit weight-only checkpoints run with tensor_parallel_size 1 "
                              f"only (got {layer.tp_size}): sharded int4 groups are not built")
        k = layer.input_size
        g = k if self.group_size == -1 else self.group_size
        if k % g or k % int4.PACK:
            int4_formats.refuse("group_size", self.group_size,
                                f"{name} has {k} input features, which groups of {g} (and "
                                f"words of 8 values) must divide")
        return g

    def prepare(self, model: nn.Module) -> int:
        """Before loading: each quantized linear's parameters, named as the checkpoint."""
        spec = int4_formats.FORMATS[self.fmt]
        chosen = self.layers(model)
        for name, layer in chosen:
            g = self._group(name, layer)
            n, k = layer.weight.shape
            device, dtype = layer.weight.device, layer.weight.dtype
            del layer.weight  # no float weight: a meta one keeps its shape for the IR call
            layer.register_buffer("weight", torch.empty(n, k, dtype=dtype, device="meta"),
                                  persistent=False)
            roles = [(spec.packed, torch.empty(n, k // int4.PACK, dtype=torch.int32)),
                     (spec.scales, torch.empty(n, k // g, dtype=torch.float32))]
            if spec.zeros is not None and not (self.fmt == "compressed-tensors"
                                               and self.symmetric):
                roles.append((spec.zeros, torch.empty(n, k // g, dtype=torch.uint8)))
            for (pname, convert), tensor in roles:
                setattr(layer, pname, _param(tensor.to(device), _converting_loader(layer,
                                                                                    convert)))
            if spec.checked is not None:
                shards = len(getattr(layer, "output_sizes", ())) or (
                    3 if hasattr(layer, "q_size") else 1)
                checked = _param(torch.zeros(shards, dtype=torch.int8),
                                 self._checker(layer, spec.checked, g))
                # older GPTQ tools saved no g_idx: in order, as desc_act false says (vLLM
                # loads such checkpoints too)
                checked.optional_in_checkpoint = spec.checked == "g_idx"
                setattr(layer, spec.checked, checked)
            layer.int4_roles = (spec.packed[0], spec.scales[0],
                                spec.zeros[0] if len(roles) == 3 else None, spec.checked)
            layer.int4_group = g
            layer.quant_method = Int4LinearMethod(g)
            layer.supports_cpu_packing = False
            for buf in cpu_gemm.BUFFERS:
                setattr(layer, buf, None)
        logger.info("W4A16 (%s): %d linear layers load 4-bit weights", self.fmt, len(chosen))
        return len(chosen)

    def _checker(self, layer: LinearBase, what: str, group: int):
        def load(param, loaded: torch.Tensor, shard_id=None) -> None:
            if what == "g_idx":
                int4_formats.check_g_idx(loaded, self.group_size)
            elif int(loaded.reshape(-1)[-1]) != layer.input_size:
                raise ConfigError(f"weight_shape {loaded.tolist()} has {int(loaded[-1])} input "
                                  f"features where the config gives {layer.input_size}")
            param.data[_SHARD_INDEX.get(shard_id, shard_id)] = 1
        return load

    @torch.no_grad()
    def quantize_loaded(self, model: nn.Module) -> int:
        """The loaded tensors under their canonical names; then Q4_1 kernel blocks where the
        native GGUF kernel serves the layer (the canonical tensors let go)."""
        converted = 0
        layers = [m for m in model.modules() if hasattr(m, "int4_roles")]
        for layer in layers:
            packed, scales, zeros, checked = layer.int4_roles
            tensors = {"weight_packed": getattr(layer, packed), "weight_scale": getattr(layer, scales),
                       "weight_zero_point": getattr(layer, zeros) if zeros else None}
            for name in {packed, scales, zeros, checked} - {None}:
                delattr(layer, name)
            for name, t in tensors.items():
                setattr(layer, name, t)
            del layer.int4_roles
            converted += to_blocks(layer)
        if converted:
            logger.info("W4A16: %d of %d layers' weights in Q4_1 kernel blocks (%.2f bits a "
                        "weight)", converted, len(layers), 8 * 24 / 32)
        return len(layers)


def blocks_serve(layer: LinearBase) -> bool:
    """Whether the native GGUF kernel would run this layer from Q4_1 blocks."""
    w, device = layer.weight, layer.weight_packed.device  # the weight is a meta stand-in
    return (device.type == "cpu" and w.dtype in build.DTYPES
            and int4.converts_to_blocks(w.shape[1], layer.int4_group)
            and ir.gguf_linear.chosen(device.type, w.dtype) == "native"
            and build.available() and gguf_matmul.available())


def to_blocks(layer: LinearBase) -> bool:
    """Turn the layer's canonical int4 weight into Q4_1 kernel blocks, served at every row count
    (no dense or packed copy), where `blocks_serve`; the layer then takes the gguf_linear call."""
    if not blocks_serve(layer):
        return False
    blocks = int4.to_q4_1_blocks(layer.weight_packed, layer.weight_scale,
                                 layer.weight_zero_point, layer.int4_group)
    cpu_gemm.attach_kernel_blocks(layer, int4.Q4_1, blocks)
    for name in ("weight_packed", "weight_scale", "weight_zero_point"):
        setattr(layer, name, None)
    layer.quant_method = None
    return True
