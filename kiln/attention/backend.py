"""The attention backend interface: KV cache layout, capabilities, and the impl class.

A backend is a class with static methods; the Attention layer builds one impl per layer from it.
"""
import torch

from kiln.attention.metadata import AttentionMetadata
from kiln.errors import ConfigError


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                   head_size: int) -> tuple[int, int, int, int, int]:
    """Shape of one layer's paged KV cache: [2 (K, V), num_blocks, block_size, kv_heads, head]."""
    return (2, num_blocks, block_size, num_kv_heads, head_size)


class AttentionImpl:
    """Per-layer attention computation over the paged cache.

    sliding_window: a query sees only the last `sliding_window` keys, its own included (HF's and
    vLLM's meaning; None: every key before it). logits_soft_cap: the scaled scores become
    cap * tanh(score / cap) before the softmax (Gemma-2; None: none). k_scale / v_scale: an fp8
    cache's scales (1.0 unless the checkpoint gives them)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None):
        if num_heads % num_kv_heads:
            raise ConfigError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                              f"({num_kv_heads})")
        if sliding_window is not None and sliding_window < 1:
            raise ConfigError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ConfigError(f"attn_logit_softcapping must be > 0 or None, got "
                              f"{logits_soft_cap}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        # an fp8 cache's per-tensor scales (kiln/attention/kv_cache_scales.py): it stores
        # x / scale and reads stored * scale; set by the layer from its checkpoint
        self.k_scale = self.v_scale = 1.0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor | None, attn_metadata: AttentionMetadata | None,
                out: torch.Tensor) -> None:
        """Write this step's K/V into kv_cache and fill out [T, nh*hd] in place."""
        raise NotImplementedError


class AttentionBackend:
    name: str = "base"
    # True when the whole forward (attention included) may be captured in one CUDA graph.
    supports_full_cudagraph: bool = False

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        raise NotImplementedError

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, ...]:
        return kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def begin_step(attn_metadata, block_size: int) -> None:
        """Called by the model runner in a step's forward context, before the model runs: work
        every layer of the step shares (none by default)."""


BACKENDS = ("torch", "cpu")


def get_attn_backend(platform=None) -> type[AttentionBackend]:
    """The backend of the IR op unified_attention's chosen provider (kiln/ir/attention.py: on
    CPU by default `cpu`, the C kernel for short queries, when it builds);
    `KILN_ATTENTION_BACKEND` (torch | cpu) overrides."""
    from kiln import envs
    from kiln.ir.attention import BACKENDS as IR_BACKENDS
    from kiln.ir.attention import unified_attention

    name = envs.attention_backend()
    if name is None:
        if platform is None:
            from kiln.platforms import current_platform as platform
        device = "cpu" if platform.is_cpu() else "cuda"
        name = IR_BACKENDS[unified_attention.chosen(device, torch.float32)]
        if name == "cpu" and device != "cpu":
            name = "torch"
    if name not in BACKENDS:
        raise ConfigError(f"KILN_ATTENTION_BACKEND={name!r} is not one of {', '.join(BACKENDS)}")
    if name == "cpu":
        from kiln.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend
    from kiln.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend
