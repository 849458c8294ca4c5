"""The IR's per-layer ops (RMSNorm with and without the residual add, SiLU- and GELU-and-mul,
GELU, rotary embedding, the dense linear): schema, fake and the plain-torch reference that
defines each one's meaning.

References round where Hugging Face's torch code does (normalise in float32, scale in the input
dtype), so an implementation that matches them matches HF in bfloat16 too.
"""
import torch
import torch.nn.functional as F

from kiln.ir.op import define


def _rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., hidden] (any float dtype), weight [hidden] -> weight * dtype(x32 * rsqrt(mean(x32^2)
    + eps)) [..., hidden], x32 = x in float32; the result's dtype is weight's and x's promoted."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))


def _fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., hidden] of one dtype -> (rms_norm(s, weight, eps), s), s = x + residual
    rounded to that dtype. Functional: both are new tensors."""
    total = x + residual
    return _rms_norm_ref(total, weight, eps), total


def _fused_add_rms_norm_fake(x, residual, weight, eps):
    return _rms_norm_fake(x, weight, eps), torch.empty_like(x)


def _silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2d] = [gate | up] -> dtype(silu(gate)) * up [..., d], x's dtype."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def _silu_and_mul_fake(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def _gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2d] = [gate | up] -> dtype(gelu_tanh(gate)) * up [..., d], x's dtype (GeGLU: HF's
    gelu_pytorch_tanh(gate_proj(x)) * up_proj(x)). Only the torch provider implements it, and
    no fusion pass matches it (they match silu_and_mul)."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def _gelu_ref(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """x [..., d] -> gelu(x) [..., d], x's dtype: the erf form (approximate "none": HF's
    "gelu") or the tanh one ("tanh": gelu_pytorch_tanh), as F.gelu. The non-gated MLPs'
    activation (StarCoder2, GPT-NeoX, Phi); native provider: csrc/layer_norm.c."""
    return F.gelu(x, approximate=approximate)


def _gelu_fake(x, approximate):
    return torch.empty_like(x)


def _rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 head_size: int) -> torch.Tensor:
    """(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) for each head's halves, written as one
    elementwise expression of x and x with its halves swapped: no concatenation, which
    Inductor's CPU backend lowers to views of one buffer, each made per call."""
    num_tokens, heads = x.shape[0], x.shape[1] // head_size  # (not -1: ambiguous at 0 tokens)
    x = x.reshape(num_tokens, heads, 2, head_size // 2)  # [T, heads, 2 halves, hd/2]
    sign = torch.arange(2, dtype=x.dtype, device=x.device).view(2, 1) * 2 - 1  # -1, +1
    out = x * cos.unsqueeze(2) + x.flip(2) * sin.unsqueeze(2) * sign
    return out.reshape(num_tokens, heads * head_size)


def _rotate_gptj(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 head_size: int) -> torch.Tensor:
    """The same rotation of each head's interleaved pairs (x[2i], x[2i+1])."""
    num_tokens, heads = x.shape[0], x.shape[1] // head_size
    x = x.reshape(num_tokens, heads, head_size // 2, 2)  # [T, heads, hd/2 pairs, 2]
    x1, x2 = x[..., 0], x[..., 1]
    out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.reshape(num_tokens, heads * head_size)


def _rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                cos_sin_cache: torch.Tensor, head_size: int,
                is_neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] (integers in [0, max_pos)); q [T, nq*hd], k [T, nk*hd] of one dtype (rows
    may be strided); cos_sin_cache [max_pos, hd] float32 (cos | sin halves) -> rotated copies
    of q and k, contiguous, in their dtype, cos and sin first rounded to it. is_neox: each
    head's halves rotate together (Llama); else its interleaved pairs (GPT-J)."""
    cos_sin = cos_sin_cache.index_select(0, positions).to(q.dtype)  # [T, hd]
    cos, sin = cos_sin.view(positions.numel(), 1, head_size).chunk(2, dim=-1)  # [T, 1, hd/2]
    rotate = _rotate_neox if is_neox else _rotate_gptj
    return rotate(q, cos, sin, head_size), rotate(k, cos, sin, head_size)


def _rotary_fake(positions, q, k, cos_sin_cache, head_size, is_neox):
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                packed: torch.Tensor | None = None,
                plan: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T (+ bias [out]) -> [..., out], as F.linear. What the
    layer holds beside its weight (kiln/model/layers/cpu_gemm.py) is for the native kernel:
    `packed`, oneDNN's blocked copy of the same values; `plan` int64 [gemv_rows, block_rows,
    limbs], up to how many rows the GEMV kernel takes the weight. An implementation that reads
    them computes this too, within their kernel's stated rounding. (A weight held as GGUF
    blocks is the IR op gguf_linear's, kiln/ir/gguf.py.)"""
    return F.linear(x, weight, bias)


def _linear_fake(x, weight, bias=None, packed=None, plan=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _examples(dtype: torch.dtype, device: str):
    def t(*shape, **kw):
        return torch.randn(*shape, dtype=kw.get("dtype", dtype), device=device)
    return t


rms_norm = define(
    "rms_norm", "(Tensor x, Tensor weight, float eps) -> Tensor", _rms_norm_ref, _rms_norm_fake,
    lambda dtype, device: (_examples(dtype, device)(2, 64), _examples(dtype, device)(64), 1e-6))

fused_add_rms_norm = define(
    "fused_add_rms_norm", "(Tensor x, Tensor residual, Tensor weight, float eps) -> "
    "(Tensor, Tensor)", _fused_add_rms_norm_ref, _fused_add_rms_norm_fake,
    lambda dtype, device: (_examples(dtype, device)(2, 64), _examples(dtype, device)(2, 64),
                           _examples(dtype, device)(64), 1e-6))

silu_and_mul = define(
    "silu_and_mul", "(Tensor x) -> Tensor", _silu_and_mul_ref, _silu_and_mul_fake,
    lambda dtype, device: (_examples(dtype, device)(2, 64),))

gelu_tanh_and_mul = define(
    "gelu_tanh_and_mul", "(Tensor x) -> Tensor", _gelu_tanh_and_mul_ref, _silu_and_mul_fake,
    lambda dtype, device: (_examples(dtype, device)(2, 64),))

gelu = define(
    "gelu", "(Tensor x, str approximate) -> Tensor", _gelu_ref, _gelu_fake,
    lambda dtype, device: (_examples(dtype, device)(2, 64), "none"))

rotary_embedding = define(
    "rotary_embedding", "(Tensor positions, Tensor q, Tensor k, Tensor cos_sin_cache, "
    "int head_size, bool is_neox) -> (Tensor, Tensor)", _rotary_ref, _rotary_fake,
    lambda dtype, device: (torch.arange(2, device=device), _examples(dtype, device)(2, 128),
                           _examples(dtype, device)(2, 64),
                           _examples(dtype, device)(8, 64, dtype=torch.float32), 64, True))

linear = define(
    "linear", "(Tensor x, Tensor weight, Tensor? bias=None, Tensor? packed=None, "
    "Tensor? plan=None) -> Tensor", _linear_ref,
    _linear_fake,
    lambda dtype, device: (_examples(dtype, device)(2, 64), _examples(dtype, device)(32, 64),
                           None))
