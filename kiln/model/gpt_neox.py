"""GPT-NeoX (Pythia): LayerNorms, biased linears, a GELU MLP, rope over the first `rotary_pct`
of each head, and (use_parallel_residual, the default) attention and MLP both reading the
layer's input: h + attn(ln1(h)) + mlp(ln2(h)).

Kiln holds it in the Llama-style modules; the checkpoint's names (gpt_neox.embed_in,
attention.query_key_value, mlp.dense_h_to_4h, embed_out, ...) are mapped on load, and the
fused query_key_value, laid out per head ([heads, 3 (q|k|v), head_dim] rows), is split into
q / k / v so the QKV layer's loaders shard it by heads under tensor parallelism.
"""
import re
from collections.abc import Iterable, Iterator

import torch

from kiln.attention.kv_cache_scales import kv_scale_target
from kiln.compilation.decorator import support_torch_compile
from kiln.errors import ConfigError
from kiln.model.layers.layernorm import LayerNorm
from kiln.model.layers.quantization import int4_formats
from kiln.model.llama import LlamaDecoderLayer, LlamaStyleForCausalLM, LlamaStyleModel
from kiln.model.partial_rotary import PartialRotaryAttention
from kiln.model.starcoder2 import GeluMLP

# checkpoint name part -> Kiln's, applied in order (the fused qkv is split after)
_RENAMES = ((re.compile(r"^gpt_neox\.embed_in\."), "model.embed_tokens."),
            (re.compile(r"^gpt_neox\.final_layer_norm\."), "model.norm."),
            (re.compile(r"^gpt_neox\."), "model."),
            (re.compile(r"^embed_out\."), "lm_head."),
            (re.compile(r"\.attention\.query_key_value\."), ".self_attn.qkv_proj."),
            (re.compile(r"\.attention\.dense\."), ".self_attn.o_proj."),
            (re.compile(r"\.mlp\.dense_h_to_4h\."), ".mlp.c_fc."),
            (re.compile(r"\.mlp\.dense_4h_to_h\."), ".mlp.c_proj."),
            # what else the attention block holds: an fp8 KV cache's k_scale / v_scale
            (re.compile(r"^(model\.layers\.\d+)\.attention\."), r"\1.self_attn."))
# Kiln module name part -> the checkpoint's (what a quantization_config's ignore list names)
_MODULE_NAMES = (("model.embed_tokens", "gpt_neox.embed_in"),
                 ("model.norm", "gpt_neox.final_layer_norm"), ("lm_head", "embed_out"),
                 (".self_attn.qkv_proj", ".attention.query_key_value"),
                 (".self_attn.o_proj", ".attention.dense"),
                 (".mlp.c_fc", ".mlp.dense_h_to_4h"), (".mlp.c_proj", ".mlp.dense_4h_to_h"),
                 ("model.layers.", "gpt_neox.layers."))
# buffers older checkpoints saved (HF's _keys_to_ignore_on_load_unexpected)
_IGNORED = re.compile(r"\.attention\.(bias|masked_bias)$")


class GPTNeoXMLP(GeluMLP):
    bias_field = None  # HF's dense_h_to_4h / dense_4h_to_h always carry one


def check_gpt_neox_heads(hf_config) -> None:
    """HF's GPT-NeoX never reads num_key_value_heads or head_dim (every head has its own K/V
    of hidden_size / num_attention_heads dims); Kiln's attention and KV cache would, so a
    config where they say otherwise is refused rather than served as another model."""
    heads = hf_config.num_attention_heads
    implied = {"num_key_value_heads": heads, "head_dim": hf_config.hidden_size // heads}
    for field, value in implied.items():
        given = getattr(hf_config, field, None)
        if given is not None and given != value:
            raise ConfigError(f"GPTNeoXForCausalLM: config field {field}={given} is not read by "
                              f"HF's GPT-NeoX, which uses {value}; remove it from config.json "
                              f"(or --hf-overrides '{{\"{field}\": {value}}}')")


class GPTNeoXAttention(PartialRotaryAttention):
    def __init__(self, hf_config, prefix: str):
        check_gpt_neox_heads(hf_config)
        super().__init__(hf_config, prefix)

    def qkv_bias(self, hf_config) -> bool:
        return bool(getattr(hf_config, "attention_bias", True))

    def o_proj_bias(self, hf_config) -> bool:
        return bool(getattr(hf_config, "attention_bias", True))


class GPTNeoXDecoderLayer(LlamaDecoderLayer):
    attention_cls = GPTNeoXAttention
    mlp_cls = GPTNeoXMLP
    norm_cls = LayerNorm
    eps_field = "layer_norm_eps"

    def __init__(self, hf_config, prefix: str):
        super().__init__(hf_config, prefix)
        self.parallel_residual = bool(getattr(hf_config, "use_parallel_residual", True))

    def forward(self, positions, hidden, residual):
        if not self.parallel_residual:  # h1 = h + attn(ln1(h)); out = h1 + mlp(ln2(h1))
            return super().forward(positions, hidden, residual)
        if residual is None:
            h, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, h = self.input_layernorm(hidden, residual)  # h: the layer's input
        attn = self.self_attn(positions, normed)
        mlp = self.mlp(self.post_attention_layernorm(h))
        # the next layer adds h: (mlp + attn) + h, HF's order
        return mlp + attn, h


@support_torch_compile
class GPTNeoXModel(LlamaStyleModel):
    layer_cls = GPTNeoXDecoderLayer


def split_query_key_value(name: str, tensor: torch.Tensor,
                          hf_config) -> list[tuple[str, torch.Tensor]]:
    """A (Kiln-named) qkv_proj tensor (weight, bias, weight_scale) as its q / k / v parts: rows
    [heads, 3, head_dim] unbound along the 3. Any other tensor is returned as it is."""
    if ".qkv_proj." not in name or kv_scale_target(name) is not None:  # a KV scale: whole
        return [(name, tensor)]
    heads = hf_config.num_attention_heads
    rows = 3 * hf_config.hidden_size
    names = [name.replace(".qkv_proj.", f".{part}_proj.") for part in ("q", "k", "v")]

    def split(t: torch.Tensor) -> list[torch.Tensor]:
        per_head = t.reshape(heads, 3, -1, *t.shape[1:])  # [heads, 3, hd, ...]
        return [per_head[:, i].reshape(-1, *t.shape[1:]) for i in range(3)]

    # a 4-bit checkpoint's tensors keep the rows elsewhere (GPTQ / AWQ: columns, packed)
    parts = int4_formats.split_rows(hf_config, name.rpartition(".")[2], tensor, rows, split)
    if parts is not None:
        return list(zip(names, parts))
    if tensor.dim() == 0 or tensor.shape[0] != rows:
        raise ConfigError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected "
                          f"{rows} rows (3 x hidden_size); the checkpoint does not match its "
                          "config (hidden_size, num_attention_heads)")
    return list(zip(names, split(tensor)))


class GPTNeoXForCausalLM(LlamaStyleForCausalLM):
    model_cls = GPTNeoXModel

    checkpoint_renames = _RENAMES
    checkpoint_module_names = _MODULE_NAMES

    def kiln_named(self, weights: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if not _IGNORED.search(name):
                yield from split_query_key_value(self.kiln_name(name), tensor, self.config)
