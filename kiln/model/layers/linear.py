"""Linear layers shaped for tensor parallelism: replicated, column-, row-parallel, merged QKV/gate-up.

Each weight carries a `weight_loader(param, loaded, shard_id=None)` that places an HF tensor
into its slice (merged shards, and this rank's part when tp_size > 1).
"""
import torch
from torch import nn

from kiln.distributed.communication_op import tensor_model_parallel_all_reduce
from kiln.distributed.parallel_state import get_tp_group
from kiln.errors import ConfigError
from kiln.model.layers import cpu_gemm
from kiln.model.layers.eager_call import EagerCall

_CONFIG_HINT = ("; the checkpoint does not match the model its config describes (config.json or "
                "the GGUF metadata: sizes, head counts, head_dim)")


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    # float16 / bfloat16 checkpoints load into any float dtype; integers would be cast silently.
    # An int8 parameter (W8A8, kiln/model/layers/quantization/) takes int8 values only.
    if param.dtype == torch.int8 or loaded.dtype == torch.int8:
        if loaded.dtype != param.dtype:
            raise ConfigError(f"checkpoint dtype {loaded.dtype} where {param.dtype} is expected "
                              "(a quantized layer's int8 weight, or a float weight the "
                              "quantization_config does not quantize)")
    elif not param.is_floating_point():  # a 4-bit layer's packed weight or zero points
        if loaded.dtype != param.dtype:
            raise ConfigError(f"checkpoint dtype {loaded.dtype} where {param.dtype} is expected "
                              "(a 4-bit layer's packed weight or zero points)")
    elif not loaded.is_floating_point():
        raise ConfigError(f"checkpoint dtype {loaded.dtype} is not a floating-point type; "
                          "Kiln loads float32, float16 or bfloat16 weights, and int8 ones where "
                          "a compressed-tensors quantization_config says so (W8A8); a scale "
                          "stored as integers is no such checkpoint")
    if param.shape != loaded.shape:
        raise ConfigError(f"weight shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
                          f"{tuple(loaded.shape)}{_CONFIG_HINT}")
    param.data.copy_(loaded)


def check_scale(loaded: torch.Tensor) -> torch.Tensor:
    """A quantized weight's stored scale, refused when it holds NaN or infinity: the
    weight's rows would then compute NaN, and a model of them generate garbage (token 0)."""
    if loaded.is_floating_point() and not bool(torch.isfinite(loaded).all()):
        raise ConfigError(f"weight_scale holds {int((~torch.isfinite(loaded)).sum())} NaN or "
                          "infinite values; the checkpoint is damaged: quantize it again")
    return loaded


def take_shard(loaded: torch.Tensor, dim: int, rank: int, size: int,
               num_shards: int) -> torch.Tensor:
    """This rank's `size` slice of `loaded` along dim, after checking the full extent."""
    if loaded.shape[dim] != size * num_shards:
        raise ConfigError(f"weight shape mismatch: checkpoint {tuple(loaded.shape)} has "
                          f"{loaded.shape[dim]} along dim {dim}, expected {size * num_shards}"
                          f"{_CONFIG_HINT}")
    return loaded.narrow(dim, rank * size, size)


def tp_rank_and_size(tp_rank: int | None, tp_size: int | None) -> tuple[int, int]:
    """The given (rank, size), or this process's tensor-parallel group's when not given."""
    if tp_size is None:
        group = get_tp_group()
        return group.rank_in_group, group.world_size
    return (tp_rank or 0), tp_size


class LinearBase(EagerCall):
    """y = x W^T (+ b) with W [output_size_per_rank, input_size_per_rank], by the IR op for what
    the layer holds (cpu_gemm.linear_call; its quant method's ops for a quantized layer)."""

    supports_cpu_packing = True  # see kiln/model/layers/cpu_gemm.py
    quant_method = None  # set by kiln/model/layers/quantization/ for a quantized layer
    # False: the methods that quantize every linear (online int8 / fp8; GPTQ and AWQ, whose
    # tools quantize the decoder layers) leave this one in its dtype: an MoE router, a
    # classifier's score head. A compressed-tensors checkpoint's targets / ignore decide alone.
    online_quantization = True
    call_fields = cpu_gemm.CALL_FIELDS

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_rank: int | None = None,
                 tp_size: int | None = None):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_rank, tp_size)
        self.weight = nn.Parameter(torch.empty(self._out_local(), self._in_local()),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(self._out_local()), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        cpu_gemm.init_cpu_forms(self)

    def _out_local(self) -> int:
        return self.output_size

    def _in_local(self) -> int:
        return self.input_size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, loaded)

    def _forward_bias(self) -> torch.Tensor | None:
        return self.bias

    def _build_call(self) -> tuple:
        return cpu_gemm.linear_call(self, self._forward_bias())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, self._forward_bias())
        return self._call(x)  # the IR call, looked up once in eager forwards (eager_call.py)


class ReplicatedLinear(LinearBase):
    """The full weight on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool):
        super().__init__(input_size, output_size, bias, tp_rank=0, tp_size=1)


def _split(size: int, tp_size: int, what: str) -> int:
    if size % tp_size:
        raise ConfigError(f"{what} ({size}) is not divisible by tensor_parallel_size ({tp_size})")
    return size // tp_size


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank keeps its slice of the output."""

    def _out_local(self) -> int:
        return _split(self.output_size, self.tp_size, "output size")

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        size = param.shape[0]
        default_weight_loader(param, take_shard(loaded, 0, self.tp_rank, size, self.tp_size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed across ranks (unless
    `reduce_results` is False: the caller sums them, once with other partial sums, as a
    mixture-of-experts block does with its shared expert)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_rank: int | None = None,
                 tp_size: int | None = None, reduce_results: bool = True):
        self.reduce_results = reduce_results
        super().__init__(input_size, output_size, bias, tp_rank, tp_size)

    def _in_local(self) -> int:
        return _split(self.input_size, self.tp_size, "input size")

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if param.dim() == 1:  # the bias is added once, whole
            default_weight_loader(param, loaded)
            return
        size = param.shape[1]
        default_weight_loader(param, take_shard(loaded, 1, self.tp_rank, size, self.tp_size))

    def _forward_bias(self) -> torch.Tensor | None:
        return self.bias if self.tp_rank == 0 else None  # the bias is added once, on rank 0

    def partial_sum(self, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden]: this rank's share of the output (LoRA adds its share here too)."""
        return super().forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.partial_sum(x)  # [T, hidden], this rank's partial sum
        if self.tp_size > 1 and self.reduce_results:
            return tensor_model_parallel_all_reduce(out)
        return out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs (e.g. gate and up) in one matmul; shard_id is the index."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool,
                 tp_rank: int | None = None, tp_size: int | None = None):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if shard_id is None:
            raise ValueError("merged linear weights load per shard; shard_id is required")
        local = [_split(s, self.tp_size, "merged output size") for s in self.output_sizes]
        offset, size = sum(local[:shard_id]), local[shard_id]
        loaded = take_shard(loaded, 0, self.tp_rank, size, self.tp_size)
        default_weight_loader(param.data.narrow(0, offset, size), loaded)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul: output = [q heads | k heads | v heads] * head_size."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool, tp_rank: int | None = None,
                 tp_size: int | None = None):
        tp_rank, tp_size = tp_rank_and_size(tp_rank, tp_size)
        self.head_size = head_size
        self.num_heads = _split(total_num_heads, tp_size, "num_attention_heads")
        # With more ranks than KV heads, KV heads are replicated across ranks.
        if tp_size >= total_num_kv_heads:
            if tp_size % total_num_kv_heads:
                raise ConfigError(f"tensor_parallel_size ({tp_size}) must divide or be a multiple "
                                  f"of num_key_value_heads ({total_num_kv_heads})")
            self.num_kv_heads, self.kv_replicas = 1, tp_size // total_num_kv_heads
        else:
            self.num_kv_heads = _split(total_num_kv_heads, tp_size, "num_key_value_heads")
            self.kv_replicas = 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp_size
        super().__init__(hidden_size, output_size, bias, tp_rank, tp_size)

    def _out_local(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_size

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_size

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"QKV weights load per shard 'q', 'k' or 'v'; got {shard_id!r}")
        if shard_id == "q":
            offset, size, rank = 0, self.q_size, self.tp_rank
        else:
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, rank = self.kv_size, self.tp_rank // self.kv_replicas
        shards = self.tp_size if shard_id == "q" else self.tp_size // self.kv_replicas
        loaded = take_shard(loaded, 0, rank, size, shards)
        default_weight_loader(param.data.narrow(0, offset, size), loaded)
