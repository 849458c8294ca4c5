"""W4A16 linear layers: 4-bit weights with group-wise float scales (and zero points), activations in
the model dtype, read from compressed-tensors pack-quantized, GPTQ or AWQ checkpoints.

`Int4WeightConfig.prepare(model)` gives each quantized linear parameters named as its format
stores them, whose loaders convert to Kiln's canonical int4 layout (kiln/ir/int4.py);
`quantize_loaded` then keeps each in that layout (scales narrowed to the 16-bit dtype the
checkpoint stored them in) and the layer runs the IR op int4_weight_linear on it. At tensor
parallelism a column-parallel layer loads its output rows, a row-parallel one its input groups.
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
from kiln.model.layers.linear import LinearBase, RowParallelLinear, default_weight_loader
from kiln.model.layers.quantization import int4_formats
from kiln.native import int4_linear

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
    if shard_id == "q":
        return layer.q_size * layer.tp_size
    if shard_id in ("k", "v"):
        return layer.kv_size * (layer.tp_size // layer.kv_replicas)
    if shard_id is not None:
        return layer.output_sizes[shard_id]
    return layer.output_size


def _param(tensor: torch.Tensor, loader) -> nn.Parameter:
    p = nn.Parameter(tensor, requires_grad=False)
    p.weight_loader = loader
    return p


def _converting_loader(layer: LinearBase, convert, whole: bool = False):
    """Loads a checkpoint tensor converted to the canonical layout into this rank's slice;
    `whole`: loaded unsharded (a row-parallel layer's per-channel scales and zero points, the
    same for every rank's part of a row)."""
    def load(param, loaded: torch.Tensor, shard_id=None) -> None:
        canonical = convert(loaded, _full_rows(layer, shard_id))
        if whole:
            default_weight_loader(param, canonical)
        elif shard_id is None:
            layer.weight_loader(param, canonical)
        else:
            layer.weight_loader(param, canonical, shard_id)
    return load


def _stored_zeros(zeros: torch.Tensor | None) -> torch.Tensor | None:
    """Zero points to keep: none where every one is 8, the implied value (symmetric GPTQ / AWQ
    checkpoints store them anyway: a byte a group saved)."""
    return None if zeros is None or bool((zeros == 8).all()) else zeros


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
                if isinstance(m, LinearBase) and m.online_quantization
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
        """The layer's group size on this rank, refusing one its input width does not split into
        (a row-parallel layer's share of the inputs: a group may not straddle two ranks)."""
        k, local = layer.input_size, layer.weight.shape[1]
        g = k if self.group_size == -1 else self.group_size
        if k % g or k % int4.PACK:
            int4_formats.refuse("group_size", self.group_size,
                                f"{name} has {k} input features, which groups of {g} (and "
                                f"words of 8 values) must divide")
        if local == k:
            return g
        if self.group_size == -1:  # per channel: each rank's part of a row keeps its scale
            return local
        if local % g or local % int4.PACK:
            raise ConfigError(
                f"tensor_parallel_size {layer.tp_size}: {name} splits its {k} input features "
                f"into {local} a rank, which quantization_config.group_size={g} (and words of "
                f"8 values) does not divide: a group would straddle two ranks; use a "
                f"tensor_parallel_size whose share of {k} is a multiple of {g}")
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
            # per channel at tp > 1: a row-parallel rank's scales and zeros are the whole rows'
            per_rank_rows = isinstance(layer, RowParallelLinear) and (
                k != layer.input_size and self.group_size == -1)
            for i, ((pname, convert), tensor) in enumerate(roles):
                loader = _converting_loader(layer, convert, whole=per_rank_rows and i > 0)
                setattr(layer, pname, _param(tensor.to(device), loader))
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
        """The loaded tensors under their canonical names, the scales in the narrowest 16-bit
        dtype that holds them exactly (int4_linear.compact_scales), zero points all 8 dropped."""
        layers = [m for m in model.modules() if hasattr(m, "int4_roles")]
        bits = 0.0
        for layer in layers:
            packed, scales, zeros, checked = layer.int4_roles
            tensors = {"weight_packed": getattr(layer, packed).data,
                       "weight_scale": int4_linear.compact_scales(getattr(layer, scales).data),
                       "weight_zero_point": _stored_zeros(getattr(layer, zeros).data
                                                          if zeros else None)}
            for name in {packed, scales, zeros, checked} - {None}:
                delattr(layer, name)
            for name, t in tensors.items():
                setattr(layer, name, None if t is None else nn.Parameter(t, requires_grad=False))
            del layer.int4_roles
            bits = max(bits, int4_linear.bits_per_weight(*tensors.values()))
        if layers:
            logger.info("W4A16: %d layers hold %.2f bits a weight (scales and zero points "
                        "included)", len(layers), bits)
        return len(layers)
