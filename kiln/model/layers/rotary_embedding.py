"""Rotary position embedding (neox style, as HF Llama; over part of each head for GPT-NeoX and
Phi; over interleaved pairs for Cohere, ERNIE-4.5 and, over part of each head, GLM-4; none on
the NoPE layers of SmolLM3 / EXAONE-4): a cos/sin cache indexed by positions, and the IR op
`rotary_embedding` (kiln/ir/layer_ops.py) applying it.

Its settings (theta, scaling) are read by kiln/config/rope.py; longrope's choice of factors is
longrope.py's; yarn's frequencies yarn.py's.
"""
import math

import torch
from torch import nn

from kiln import ir
from kiln.errors import ConfigError
from kiln.model.layers.longrope import longrope_factors, longrope_mscale
from kiln.model.layers.yarn import yarn_attention_factor, yarn_inv_freq


def compute_inv_freq(rotary_dim: int, base: float, scaling: dict | None,
                     max_model_len: int | None = None) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] in float32, with HF's formulas for each rope type
    (longrope's factors chosen by `max_model_len`: longrope.py)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    if scaling is not None and scaling["rope_type"] == "longrope":
        factors = longrope_factors(scaling, rotary_dim, max_model_len)
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base ** exponents)
    if scaling is not None and scaling["rope_type"] == "yarn":
        return yarn_inv_freq(rotary_dim, base, scaling)
    inv_freq = 1.0 / (base ** exponents)
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths slowed by `factor`, short kept, a smooth blend in between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    is_neox = True  # each head's halves rotate together; GPT-J style (Cohere): its pairs

    def __init__(self, head_size: int, max_position: int, base: float,
                 scaling: dict | None = None, max_model_len: int | None = None):
        super().__init__()
        self.head_size, self.max_position, self.scaling = head_size, max_position, scaling
        self.base = base
        self.inv_freq = compute_inv_freq(head_size, base, scaling, max_model_len)  # [hd/2] f32
        # longrope and yarn scale cos and sin (HF's attention_scaling): the logits' temperature
        self.mscale = 1.0 if scaling is None else yarn_attention_factor(scaling) \
            if scaling["rope_type"] == "yarn" else longrope_mscale(scaling)
        # float32 whatever the model dtype; cast at use, as HF does.
        self.register_buffer("cos_sin_cache", self._cos_sin(self.inv_freq),
                             persistent=False)  # [max_pos, hd]

    def _cos_sin(self, inv_freq: torch.Tensor) -> torch.Tensor:
        t = torch.arange(self.max_position, dtype=torch.float32, device=inv_freq.device)
        freqs = torch.outer(t, inv_freq.to(torch.float32))  # [max_pos, hd/2]
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(torch.float32)
        return cos_sin if self.mscale == 1.0 else cos_sin * self.mscale

    def divide_frequencies(self, factors: torch.Tensor) -> None:
        """Divide each frequency by its factor [hd/2]: how llama.cpp files carry rope scaling
        (the `rope_freqs` tensor of Llama 3.1+ GGUFs) instead of a rope_scaling config."""
        if self.scaling is not None:
            raise ConfigError(f"the config's rope_scaling {self.scaling['rope_type']!r} and the "
                              "checkpoint's rope frequency factors (rope_freqs) would both scale "
                              "the rotary frequencies; remove one")
        if tuple(factors.shape) != tuple(self.inv_freq.shape):
            raise ConfigError(f"rope_freqs has shape {tuple(factors.shape)}, expected "
                              f"{tuple(self.inv_freq.shape)} (head_dim / 2)")
        self.inv_freq = self.inv_freq / factors.to(self.inv_freq.device, torch.float32)
        self.cos_sin_cache.copy_(self._cos_sin(self.inv_freq))

    def fit_max_model_len(self, max_model_len: int) -> None:
        """Longrope: the factors of the engine's final max_model_len, in place (the cache's
        tensor stays the one graphs hold); other ropes do not depend on it."""
        if self.scaling is None or self.scaling["rope_type"] != "longrope":
            return
        self.inv_freq = compute_inv_freq(self.head_size, self.base, self.scaling, max_model_len)
        self.cos_sin_cache.copy_(self._cos_sin(self.inv_freq))

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [T]; q [T, nh*hd], k [T, nkv*hd] -> rotated (q, k)."""
        return ir.rotary_embedding(positions, q, k, self.cos_sin_cache, self.head_size,
                                   self.is_neox)


class InterleavedRotaryEmbedding(RotaryEmbedding):
    """Rope over each head's interleaved pairs (x[2i], x[2i+1]) (Cohere: HF's rotate_half
    there takes x[..., ::2] and x[..., 1::2], its cos / sin repeat_interleave'd), the
    rotary_embedding op's GPT-J form; the frequencies are Llama's."""
    is_neox = False


class PartialRotaryEmbedding(RotaryEmbedding):
    """Rope over the first `rotary_dim` of each head's `head_size` dims, the rest passed
    through (GPT-NeoX's rotary_pct, HF's partial_rotary_factor): the rotary_embedding op on
    those dims alone, its cache built for them (HF's frequencies are over rotary_dim too)."""

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, base: float,
                 scaling: dict | None = None, max_model_len: int | None = None):
        super().__init__(rotary_dim, max_position, base, scaling, max_model_len)
        self.full_head_size = head_size

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [T]; q [T, nh*hd], k [T, nkv*hd] -> rotated (q, k), contiguous."""
        # head counts spelled out, not -1: ambiguous in a batch of no tokens
        num_tokens, rot, hd = positions.shape[0], self.head_size, self.full_head_size
        nq, nk = q.shape[1] // hd, k.shape[1] // hd
        q3, k3 = q.reshape(num_tokens, nq, hd), k.reshape(num_tokens, nk, hd)
        q_rot, k_rot = ir.rotary_embedding(positions, q3[..., :rot].reshape(num_tokens, nq * rot),
                                           k3[..., :rot].reshape(num_tokens, nk * rot),
                                           self.cos_sin_cache, rot, self.is_neox)
        q = torch.cat((q_rot.view(num_tokens, nq, rot), q3[..., rot:]), dim=-1)
        k = torch.cat((k_rot.view(num_tokens, nk, rot), k3[..., rot:]), dim=-1)
        return q.reshape(num_tokens, nq * hd), k.reshape(num_tokens, nk * hd)


class InterleavedPartialRotaryEmbedding(PartialRotaryEmbedding):
    """GLM-4: interleaved pairs over the first rotary_dim of each head (HF's Glm4 rotate_half
    on q[..., :rotary_dim])."""
    is_neox = False


class NoRotaryEmbedding(nn.Module):
    """A NoPE layer's (SmolLM3's no_rope_layers, EXAONE-4's global layers): q and k unroped.
    Not a RotaryEmbedding, so neither shared nor fitted."""

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return q, k


def share_rotary_embeddings(layers: nn.Module) -> int:
    """Point every `rotary_emb` under `layers` at one module per distinct rotary (head size,
    positions, frequencies): each layer building its own kept a float32 [max_pos, hd] cache per
    layer (2 MB each at 8192 x 64), all equal. Returns how many distinct ones remain."""
    shared: dict[tuple, RotaryEmbedding] = {}
    for module in layers.modules():
        rotary = getattr(module, "rotary_emb", None)
        if isinstance(rotary, RotaryEmbedding):
            key = (type(rotary), getattr(rotary, "full_head_size", rotary.head_size),
                   rotary.head_size, rotary.max_position, repr(rotary.scaling),
                   tuple(rotary.inv_freq.tolist()))
            module.rotary_emb = shared.setdefault(key, rotary)
    return len(shared)


def fit_rotary_to_max_model_len(model: nn.Module, max_model_len: int) -> None:
    """Every rotary embedding of `model` fitted to the engine's max_model_len: where the KV
    cache capped it below the config's the model was built with, a longrope model whose
    sequences all fit the original length then runs the short factors, as HF does."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.fit_max_model_len(max_model_len)
