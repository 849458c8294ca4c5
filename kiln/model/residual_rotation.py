"""Calibration-free residual-stream rotation for online W8A8 int8 (QuaRot-style; on by default
where it applies: kiln/config/quantization_rotation.py): the matrix and a Llama model's transform.
"""
import math

import torch
from torch import nn

# Classes of Llama's residual stream, whose layers rotate_llama knows: plain RMSNorms before
# attention and a dense MLP, no post-norms. What they add leaves the stream alone: biases
# (which it moves), Qwen3's per-head q/k norms (on W_q x, after Q is folded into W_q), Granite's
# scalar multipliers (a scalar commutes with Q), ERNIE-4.5's interleaved rope, SmolLM3's NoPE
# layers, Phi-3's fused checkpoint tensors (split on load, before the rotation).
ROTATABLE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "GraniteForCausalLM", "Ernie4_5ForCausalLM",
                           "SeedOssForCausalLM", "SmolLM3ForCausalLM", "Phi3ForCausalLM")
MAX_HADAMARD = 64  # Q = H_64 (x) a random orthogonal d/64 x d/64 where d allows
SEED = 0


def hadamard(n: int) -> torch.Tensor:
    """Sylvester's normalised Hadamard matrix [n, n] float64 (n a power of two): orthogonal,
    every entry +-1/sqrt(n)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def random_orthogonal(n: int, seed: int) -> torch.Tensor:
    """A seeded random orthogonal [n, n] float64 (QR of a Gaussian, signs fixed so the same
    seed gives the same matrix on every machine)."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).contiguous()  # QR gives column-major


def hadamard_block(d: int) -> int:
    """The Hadamard factor of the rotation for hidden size d: the largest power of two dividing
    d, at most MAX_HADAMARD (576 -> 64, 192 -> 64, 96 -> 32)."""
    return min(d & -d, MAX_HADAMARD)


class Rotation:
    """Q = H (x) R [d, d] float64, held as its factors H [b, b] and R [m, m] (d = b m): W Q and
    Q^T W then cost d (b + m) multiply-adds a row of W, not d^2 (576: 73 against 576). A dense
    Q is Rotation(q, 1 x 1)."""

    def __init__(self, h: torch.Tensor, r: torch.Tensor):
        self.h, self.r = h.double(), r.double()
        self.b, self.m = h.shape[0], r.shape[0]
        self.d = self.b * self.m

    def to(self, device) -> "Rotation":
        return Rotation(self.h.to(device), self.r.to(device))

    def dense(self) -> torch.Tensor:
        return torch.kron(self.h, self.r)

    def right(self, w: torch.Tensor) -> torch.Tensor:
        """w Q, w [n, d]: Q[(k, l), (i, j)] = H[k, i] R[l, j]."""
        t = torch.einsum("nkl,ki->nil", w.reshape(-1, self.b, self.m), self.h)
        return (t @ self.r).reshape(-1, self.d)

    def left_t(self, w: torch.Tensor) -> torch.Tensor:
        """Q^T w, w [d, c]."""
        t = torch.einsum("ki,klc->ilc", self.h, w.reshape(self.b, self.m, -1))
        return torch.einsum("lj,ilc->ijc", self.r, t).reshape(self.d, -1)


def stream_rotation(d: int, seed: int = SEED) -> Rotation:
    """The residual stream's rotation for hidden size d: H_b (x) R, b = hadamard_block(d), R a
    seeded random orthogonal (d/b x d/b). Deterministic in (d, seed)."""
    b = hadamard_block(d)
    return Rotation(hadamard(b), random_orthogonal(d // b, seed))


def rotation_matrix(d: int, seed: int = SEED) -> torch.Tensor:
    """stream_rotation(d, seed) as its dense Q [d, d] float64."""
    return stream_rotation(d, seed).dense()


def _set(param: torch.Tensor, value: torch.Tensor) -> None:
    param.data.copy_(value.to(param.dtype))  # in place: the tensor the module holds stays


def _cleared(layer: nn.Module) -> nn.Module:
    """A linear whose weight changes: its CPU forms derived from the old one (a GGUF file's
    blocks, a packed copy) go; prepack_for_cpu derives new ones from the new weight."""
    from kiln.model.layers.cpu_gemm import BUFFERS

    for name in BUFFERS:
        setattr(layer, name, None)
    layer.cpu_qtype = 0
    return layer


def _rotate_heads_vo(attn: nn.Module, hidden: int) -> None:
    """v_proj's output and o_proj's input rotated per head by H_hd: o(attn(v H)) H^T = o(attn v),
    attention mixing whole heads. Skipped where head_dim is not a power of two."""
    hd = attn.head_dim
    if hd & (hd - 1):
        return
    qkv, o = attn.qkv_proj, attn.o_proj
    h = hadamard(hd).to(qkv.weight.device)
    start = attn.q_size + attn.kv_size
    wv = qkv.weight.data[start:].double().reshape(-1, hd, hidden)  # [kv heads, hd, d]
    qkv.weight.data[start:] = torch.einsum("ji,hjk->hik", h, wv).reshape(-1, hidden).to(
        qkv.weight.dtype)
    if qkv.bias is not None:
        bv = qkv.bias.data[start:].double().reshape(-1, hd)
        qkv.bias.data[start:] = (bv @ h).reshape(-1).to(qkv.bias.dtype)
    wo = o.weight.data.double().reshape(hidden, -1, hd)  # [d, heads, hd]
    _set(o.weight, (wo @ h).reshape(hidden, -1))


@torch.no_grad()
def rotate_llama(model: nn.Module, q: "torch.Tensor | Rotation", heads: bool = True) -> None:
    """Transform a loaded Llama model (LlamaStyleForCausalLM, one pipeline stage, float weights;
    at -tp a rank's shards, each holding the hidden dimension whole and whole heads) to carry
    its residual stream as h Q, in place; `heads`: also v / o per head.

    Each RMSNorm's weight g goes into the linears it feeds (W <- W diag(g) Q; the norm then
    scales by 1, so the fused norm + int8 quant ops still apply), the linears writing into the
    stream get W <- Q^T W (b <- b Q), the embedding's output is rotated per token and the final
    norm's un-rotated before the LM head (its weight folded in), so a tied head keeps sharing
    the embedding table. Exact in real arithmetic; Q spreads the stream's outlier channels over all of them,
    which per-token int8 activation scales then fit better. `q`: a Rotation, or a dense
    [d, d]; the products run in float64 on the weights' device."""
    backbone = model.model
    dtype, device = backbone.norm.weight.dtype, backbone.norm.weight.device
    if isinstance(q, torch.Tensor):
        q = Rotation(q, torch.ones(1, 1))
    q = q.to(device)
    d = q.d
    for layer in backbone.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if heads:
            _rotate_heads_vo(attn, d)
        for norm, readers in ((layer.input_layernorm, (attn.qkv_proj,)),
                              (layer.post_attention_layernorm, (mlp.gate_up_proj,))):
            g = norm.weight.data.double()
            for lin in readers:
                _set(_cleared(lin).weight, q.right(lin.weight.data.double() * g))
            norm.weight.data.fill_(1.0)
        for lin in (attn.o_proj, mlp.down_proj):  # they write into the stream
            _set(_cleared(lin).weight, q.left_t(lin.weight.data.double()))
            if lin.bias is not None:
                _set(lin.bias, q.right(lin.bias.data.double()[None]).reshape(-1))
    g = backbone.norm.weight.data.double()
    dense = q.dense()
    backbone.residual_rotation = dense.to(dtype=dtype)
    # norm(h Q) Q^T diag(g) == norm(h) diag(g): the RMS is the same for h Q and h; applied by
    # compute_logits, so forward's output stays rotated (what pooling would read: refused)
    backbone.residual_unrotation = (dense.t() * g).to(dtype=dtype)
    backbone.norm.weight.data.fill_(1.0)


def apply_rotation(model: nn.Module, rotation: str) -> None:
    """The loader's hook: rotate a loaded model's float weights before they are quantized
    (`rotation`: the resolved quantization_rotation, "hadamard" or "none")."""
    if rotation == "none":
        return
    if rotation != "hadamard":  # "auto" is KilnConfig's to resolve, before any load
        raise ValueError(f"apply_rotation: quantization_rotation={rotation!r} is unresolved; "
                         "load through a KilnConfig, which resolves it to hadamard or none")
    rotate_llama(model, stream_rotation(model.model.norm.weight.shape[0]))
