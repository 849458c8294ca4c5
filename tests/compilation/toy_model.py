"""A tiny Llama-like backbone whose attention is a test custom op, for the compile-stack tests.

Kept in its own module so a second process (warm-start tests) traces the very same source.
"""
import types

import torch
from torch import nn

from kiln.compilation.decorator import support_torch_compile
from kiln.config import CacheConfig, CompilationConfig, KilnConfig, ModelConfig, SchedulerConfig

SPLIT_OP = "kiln_test::toy_attention"
_LAYERS: dict[str, tuple[int, int]] = {}  # layer name -> (num_heads, head_dim)


@torch.library.custom_op(SPLIT_OP, mutates_args=["out"])
def toy_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  layer_name: str) -> None:
    num_heads, head_dim = _LAYERS[layer_name]
    t = q.shape[0]
    q, k, v = (x.view(t, num_heads, head_dim).transpose(0, 1) for x in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.copy_(o.transpose(0, 1).reshape(t, num_heads * head_dim))


@toy_attention.register_fake
def _(q, k, v, out, layer_name):
    return None


class ToyLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, name: str):
        super().__init__()
        self.heads, self.head_dim, self.name = heads, hidden // heads, name
        _LAYERS[name] = (heads, self.head_dim)
        self.norm1 = nn.RMSNorm(hidden, eps=1e-6)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = nn.RMSNorm(hidden, eps=1e-6)
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        half = self.head_dim // 2
        freqs = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
        angles = positions.float()[:, None] * freqs[None, :]  # [T, half]
        cos, sin = angles.cos().repeat(1, self.heads), angles.sin().repeat(1, self.heads)
        x1, x2 = x.view(-1, self.heads, 2, half).unbind(2)
        x1, x2 = x1.reshape(-1, self.heads * half), x2.reshape(-1, self.heads * half)
        return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], 1).view(x.shape)

    def forward(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(h)).chunk(3, dim=-1)
        q, k = self.rope(q, positions), self.rope(k, positions)
        out = torch.empty_like(q)
        torch.ops.kiln_test.toy_attention(q, k, v, out, self.name)
        h = h + self.o(out)
        gate, up = self.up(self.norm2(h)).chunk(2, dim=-1)
        return h + self.down(nn.functional.silu(gate) * up)


@support_torch_compile
class ToyModel(nn.Module):
    def __init__(self, vocab: int = 128, hidden: int = 32, num_layers: int = 2, heads: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(ToyLayer(hidden, heads, f"layers.{i}")
                                    for i in range(num_layers))
        self.norm = nn.RMSNorm(hidden, eps=1e-6)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)  # [T, hidden]
        for layer in self.layers:
            h = layer(h, positions)
        return self.norm(h)


def toy_config(mode: int = 3, backend: str = "inductor", compile_sizes=(), num_layers: int = 2,
               max_num_batched_tokens: int = 64, **compilation) -> KilnConfig:
    hf = types.SimpleNamespace(architectures=["ToyForCausalLM"], max_position_embeddings=256,
                               num_hidden_layers=num_layers, hidden_size=32, vocab_size=128,
                               num_attention_heads=2, torch_dtype="float32")
    cc = CompilationConfig(mode=mode, backend=backend, compile_sizes=list(compile_sizes),
                           splitting_ops=[SPLIT_OP], **compilation)
    return KilnConfig(model_config=ModelConfig(model="toy", hf_config=hf, dtype="float32"),
                      cache_config=CacheConfig(),
                      scheduler_config=SchedulerConfig(
                          max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens),
                      compilation_config=cc)


def build(config: KilnConfig, seed: int = 0) -> ToyModel:
    from kiln.config import set_current_kiln_config

    torch.manual_seed(seed)
    with set_current_kiln_config(config):
        return ToyModel(num_layers=config.model_config.hf_config.num_hidden_layers).eval()


def inputs(num_tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + num_tokens)
    return (torch.randint(0, 128, (num_tokens,), generator=g),
            torch.arange(num_tokens, dtype=torch.int64))
