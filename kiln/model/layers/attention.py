"""The Attention layer, which calls the IR op `unified_attention` under its name, and the table
of a model's layers by name: the op finds its KV cache and backend impl there via the forward context.
"""
import torch
from torch import nn

from kiln import ir
from kiln.attention import kv_cache_generation
from kiln.attention.backend import get_attn_backend
from kiln.attention.kv_cache_scales import (
    checkpoint_scale,
    effective_scales,
    reads_checkpoint_scales,
)
from kiln.config import get_current_kiln_config


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 prefix: str, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None):
        """sliding_window: this layer's (None: full attention); logits_soft_cap: Gemma-2's
        attention logit soft-capping (kiln/attention/backend.py's AttentionImpl)."""
        super().__init__()
        self.num_heads, self.head_size, self.scale = num_heads, head_size, scale
        self.num_kv_heads = num_kv_heads
        self.layer_name = prefix
        self.sliding_window, self.logits_soft_cap = sliding_window, logits_soft_cap
        # --kv-cache-dtype, and the fp8 cache scales its checkpoint gave (kv_cache_scales.py)
        kiln_config = get_current_kiln_config()
        cache_config = getattr(kiln_config, "cache_config", None)
        self.kv_cache_dtype = cache_config.cache_dtype if cache_config else "auto"
        # the model's quantization method (reads_checkpoint_scales follows from it)
        self.quantization = getattr(getattr(kiln_config, "model_config", None), "quantization",
                                    None)
        self.checkpoint_scales: dict[str, float] = {}
        self.backend = self._choose_backend()
        self.impl = self._new_impl()
        # [2, num_blocks, block_size, nkv, hd], assigned by the worker once the cache is sized.
        self.kv_cache: torch.Tensor | None = None
        # Its KV cache group (kiln/core/kv_cache_groups.py), whose block table it reads; set
        # with the cache (kiln/worker/kv_cache_layout.py).
        self.kv_group = 0

    @property
    def reads_checkpoint_scales(self) -> bool:
        """Whether this layer reads a checkpoint's k_scale / v_scale (vLLM's rule, by the
        quantization method: kv_cache_scales.py)."""
        return reads_checkpoint_scales(self.quantization)

    def _choose_backend(self):
        return get_attn_backend(get_current_kiln_config().platform)

    def _new_impl(self):
        return self.backend.get_impl_cls()(self.num_heads, self.head_size, self.scale,
                                           self.num_kv_heads, self.sliding_window,
                                           self.logits_soft_cap)

    def load_kv_scale(self, name: str, kind: str, tensor: torch.Tensor) -> tuple[str, ...]:
        """Checkpoint tensor `name` as this layer's `kind` scale (kv_scale_target's: k, v, q,
        prob; "kv" sets both), checked; the impl's scales follow (vLLM's rules:
        effective_scales). Returns the scales set (k, v, q, prob)."""
        value = checkpoint_scale(name, tensor)
        kinds = ("k", "v") if kind == "kv" else (kind,)
        for which in kinds:
            self.checkpoint_scales[which] = value
        k, v = effective_scales(self.kv_cache_dtype, self.checkpoint_scales.get("k"),
                                self.checkpoint_scales.get("v"))
        self.impl.k_scale, self.impl.v_scale = k, v
        kv_cache_generation.bump()  # the C++ kernel's layer table holds the scales
        return kinds

    @property
    def kv_cache(self) -> torch.Tensor | None:
        return self.__dict__["_kv_cache"]

    @kv_cache.setter
    def kv_cache(self, value: torch.Tensor | None) -> None:
        self.__dict__["_kv_cache"] = value
        kv_cache_generation.bump()  # views of the caches rebuild (kiln/attention/cpu_backend.py)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)  # [T, nh*hd]
        ir.unified_attention(q, k, v, out, self.layer_name)
        return out


def attention_layers(model: nn.Module) -> dict[str, Attention]:
    """Layer name -> Attention module of a built model: the table the forward context hands the
    attention op, owned by whoever owns the model (the model runner)."""
    table: dict[str, Attention] = {}
    for module in model.modules():
        if isinstance(module, Attention):
            if module.layer_name in table:
                raise ValueError(f"duplicate attention layer name {module.layer_name!r}")
            table[module.layer_name] = module
    return table
