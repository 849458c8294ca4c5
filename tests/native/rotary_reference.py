"""The rotary kernel's arithmetic (kiln/native/csrc/rotary.c) replayed in torch bit for bit, and
inputs at its edges: NaN and inf, subnormal and tiny values, zeros, products that overflow.

Each product is rounded to the dtype with dtype.h's round-to-nearest-even (NaN kept, made quiet),
then the sum; torch's own bfloat16 ops round the same but write every NaN as one NaN, so for
these inputs this replay is the reference (test_rotary_kernel.py; _tier_child.py, for the builds
of CPUs below this one).
"""
import torch

from kiln.model.layers.rotary_embedding import RotaryEmbedding

# bfloat16 bits: zeros, infinities, NaNs (quiet, signaling, with payloads), subnormals, the
# smallest normal, values either side of 2^-63 (the vector path's tininess bound), the largest
_SPECIAL_BF16 = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7FA3, 0x7F81, 0xFFD5, 0x0001,
                 0x807F, 0x0080, 0x2000, 0x1FFF, 0x9FFF, 0x2080, 0x7F7F, 0xFF7F]
_SPECIAL_F32 = [b << 16 for b in _SPECIAL_BF16] + [0x7FC00001, 0x00000001, 0x807FFFFF]


def _bits_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.int16 if dtype == torch.bfloat16 else torch.int32


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 x as dtype.h's round_to(x, dtype) leaves it: bfloat16's round to nearest even on
    the bits, a NaN's top half kept and made quiet; float32 unchanged."""
    if dtype == torch.float32:
        return x
    u = x.view(torch.int32)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) & -0x10000
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return torch.where(nan, (u | 0x400000) & -0x10000, rounded).view(torch.float32)


def _to_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """round_to's result (exact in dtype) as a tensor of dtype, NaN payloads kept."""
    if dtype == torch.float32:
        return x
    return (round_to(x, dtype).view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)


def _halves(x: torch.Tensor, hd: int, neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x1, x2 views [T, heads, hd / 2] of [T, heads * hd]: each head's halves (neox) or its
    interleaved pairs (gpt-j)."""
    t = x.shape[0]
    if neox:
        v = x.view(t, -1, 2, hd // 2)
        return v[:, :, 0], v[:, :, 1]
    v = x.view(t, -1, hd // 2, 2)
    return v[..., 0], v[..., 1]


def rotary(positions: torch.Tensor, x: torch.Tensor, cache: torch.Tensor, hd: int,
           neox: bool) -> torch.Tensor:
    """x [T, heads * hd] (float32 or bfloat16, rows may be strided) rotated as the kernel does:
    a contiguous copy."""
    dtype = x.dtype
    cs = round_to(cache.float().index_select(0, positions).contiguous(), dtype)  # [T, hd]
    c, s = cs[:, None, : hd // 2], cs[:, None, hd // 2:]
    x1, x2 = (h.float() for h in _halves(x.contiguous(), hd, neox))
    a, b = round_to(x1 * c, dtype), round_to(x2 * s, dtype)
    e, f = round_to(x2 * c, dtype), round_to(x1 * s, dtype)
    out = torch.empty(x.shape, dtype=dtype)
    o1, o2 = _halves(out, hd, neox)
    o1.copy_(_to_dtype(torch.sub(a, b), dtype))
    o2.copy_(_to_dtype(torch.add(e, f), dtype))
    return out


def edge_values(g: torch.Generator, n: int, dtype: torch.dtype, share: float) -> torch.Tensor:
    """n values of dtype: normal ones, with about `share` of them special."""
    x = torch.randn(n, generator=g).to(dtype)
    special = torch.tensor(_SPECIAL_BF16 if dtype == torch.bfloat16 else _SPECIAL_F32,
                           dtype=torch.int64)
    pick = special[torch.randint(0, len(special), (n,), generator=g)]
    where = torch.rand(n, generator=g) < share
    bits = x.view(_bits_dtype(dtype)).to(torch.int64)
    bits = torch.where(where, pick, bits)
    if dtype == torch.bfloat16:
        bits = torch.where(bits >= 0x8000, bits - 0x10000, bits)
    else:
        bits = torch.where(bits >= 2**31, bits - 2**32, bits)
    return bits.to(_bits_dtype(dtype)).view(dtype)


def one_nonfinite_a_pair(x: torch.Tensor, hd: int, neox: bool) -> None:
    """Where both values of a pair are inf or NaN, x2 made 1: an operation on two NaNs yields
    either's payload by the compiler's operand order (the portable loop's own layouts differ),
    so only one may be NaN for a bit-for-bit comparison."""
    x1, x2 = _halves(x, hd, neox)
    both = ~torch.isfinite(x1) & ~torch.isfinite(x2)
    x2.masked_fill_(both, 1.0)


def edge_cache(g: torch.Generator, max_pos: int, hd: int) -> torch.Tensor:
    """A float32 cos / sin cache [max_pos, hd] of normal values with zeros, subnormals, values
    under 2^-56 (the vector path's tininess bound for cos / sin) and large ones (products that
    overflow). Finite: a NaN cos and sin would make an operation on two NaNs."""
    c = torch.randn(max_pos, hd, generator=g)
    specials = torch.tensor([0.0, -0.0, 1e-45, -3e-39, 2.0**-57, 2.0**-56, 1.5e-17, 3e38, -2e38])
    pick = specials[torch.randint(0, len(specials), c.shape, generator=g)]
    return torch.where(torch.rand(c.shape, generator=g) < 0.02, pick, c)


# the cases' inputs: normal values; with specials in x; with specials in x and the cache; x
# near 2^-118, whose products with cos / sin are often subnormal, and so are their sums; a cache
# near 2^-128 (subnormal), the same with normal x
INPUTS = ("plain", "edges", "edge_cache", "tiny", "tiny_cache")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_bits_dtype(t.dtype))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def run_case(g: torch.Generator, dtype: torch.dtype, neox: bool, in_place: bool, tokens: int,
             hd: int, nq: int, nk: int, inputs: str):
    """((q, k) from the op, (q, k) from the replay) for q [T, nq hd] and k [T, nk hd], column
    ranges of one [T, (nq + 2 nk) hd + 3] buffer (rows strided, as a fused QKV projection's
    are), positions 0 and the cache's last among them. In place, the columns past q and k (v,
    the padding) are checked untouched (an AssertionError)."""
    max_pos = 37
    cache = (edge_cache(g, max_pos, hd) if inputs == "edge_cache"
             else RotaryEmbedding(hd, max_position=max_pos, base=10000.0).cos_sin_cache)
    if inputs == "tiny_cache":
        cache = cache * 2.0**-128
    positions = torch.randint(0, max_pos, (tokens,), generator=g)
    positions[0], positions[-1] = max_pos - 1, 0
    width = (nq + 2 * nk) * hd + 3
    qkv = edge_values(g, tokens * width, dtype, 0.03 if "edge" in inputs else 0.0)
    if inputs == "tiny":
        qkv = (qkv.float() * 2.0**-118).to(dtype)
    qkv = qkv.view(tokens, width)
    q, k = qkv[:, : nq * hd], qkv[:, nq * hd: (nq + nk) * hd]
    one_nonfinite_a_pair(q, hd, neox)
    one_nonfinite_a_pair(k, hd, neox)
    want = rotary(positions, q, cache, hd, neox), rotary(positions, k, cache, hd, neox)
    if not in_place:
        return torch.ops.kiln.rotary_embedding_native(positions, q, k, cache, hd, neox), want
    rest = qkv[:, q.shape[1] + k.shape[1]:].clone()
    torch.ops.kiln.rotary_embedding_native_(positions, q, k, cache, hd, neox)
    assert same_bits(qkv[:, q.shape[1] + k.shape[1]:], rest), "in place: v or padding written"
    return (q, k), want
