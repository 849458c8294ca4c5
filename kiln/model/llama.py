"""Llama (also Mistral-style and SmolLM): decoder layers over merged QKV / gate-up projections.

`LlamaStyleModel` is the undecorated backbone the Qwen models reuse; each architecture's
backbone is its own class so the compile decorator can wrap each one once.
"""

import re
from collections.abc import Iterable

import torch
from torch import nn

from kiln.compilation.decorator import support_torch_compile
from kiln.config import get_current_kiln_config
from kiln.config.rope import get_rope_config, rope_positions
from kiln.distributed.parallel_state import get_pp_group
from kiln.distributed.pipeline import PPMissingLayer, this_stage_layer_range
from kiln.errors import ConfigError
from kiln.model.checkpoint_names import config_bias
from kiln.model.hf_weight_loading import HFWeightLoading
from kiln.model.layers.activation import SiluAndMul
from kiln.model.layers.attention import Attention
from kiln.model.layers.layernorm import RMSNorm
from kiln.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kiln.model.layers.rotary_embedding import (
    RotaryEmbedding,
    share_rotary_embeddings,
)
from kiln.model.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding


def layer_index(prefix: str) -> int:
    """The decoder layer a module prefix ("model.layers.3.self_attn") names: 3."""
    parts = prefix.split(".")
    return int(parts[parts.index("layers") + 1])


def layer_window(prefix: str) -> int | None:
    """The sliding window of the decoder layer a module prefix names, from the engine's model
    config (None: full attention)."""
    return get_current_kiln_config().model_config.layer_sliding_window(layer_index(prefix))


def head_dim_of(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads)


class LlamaMLP(nn.Module):
    # hidden_act -> the gated activation over [gate | up] (GemmaMLP names GeGLU's)
    activations = {"silu": SiluAndMul}
    act_field = "hidden_act"  # the config field naming it (Gemma-2: hidden_activation)

    def __init__(self, hf_config, prefix: str, intermediate_size: int | None = None,
                 reduce_results: bool = True):
        super().__init__()
        bias = config_bias(hf_config, "mlp_bias")
        act = getattr(hf_config, self.act_field, "silu")
        if act not in self.activations:
            raise ConfigError(f"{prefix}: {self.act_field} {act!r} is not supported; only "
                              f"{', '.join(map(repr, self.activations))}")
        # a mixture-of-experts block's shared expert: its own size, summed with the experts'
        inter = intermediate_size or hf_config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hf_config.hidden_size, [inter, inter], bias)
        self.down_proj = RowParallelLinear(inter, hf_config.hidden_size, bias,
                                           reduce_results=reduce_results)
        self.act_fn = self.activations[act]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    rotary_cls = RotaryEmbedding  # Cohere's: over interleaved pairs

    def __init__(self, hf_config, prefix: str):
        super().__init__()
        total_heads = hf_config.num_attention_heads
        total_kv_heads = getattr(hf_config, "num_key_value_heads", None) or total_heads
        self.head_dim = head_dim_of(hf_config)
        self.qkv_proj = QKVParallelLinear(hf_config.hidden_size, self.head_dim, total_heads,
                                          total_kv_heads, self.qkv_bias(hf_config))
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hf_config.hidden_size,
                                        self.o_proj_bias(hf_config))
        # This rank's heads (tensor parallel: a share of them; KV heads may be replicated).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        theta, scaling = self.rope_config(hf_config, prefix)
        # every position max_model_len may reach (a linear scaling's factor times more); the
        # length also picks longrope's factors
        max_model_len = get_current_kiln_config().model_config.max_model_len
        self.rotary_emb = self.rotary_cls(
            self.head_dim, rope_positions(hf_config, max_model_len), theta, scaling,
            max_model_len)
        self.attn = Attention(self.num_heads, self.head_dim, self.softmax_scale(hf_config),
                              self.num_kv_heads, prefix=f"{prefix}.attn",
                              sliding_window=layer_window(prefix),
                              logits_soft_cap=self.logits_soft_cap(hf_config))

    def rope_config(self, hf_config, prefix: str) -> tuple[float, dict | None]:
        """This layer's (rope_theta, scaling) (Gemma-3: its own for sliding layers)."""
        return get_rope_config(hf_config)

    def softmax_scale(self, hf_config) -> float:
        return self.head_dim ** -0.5

    def logits_soft_cap(self, hf_config) -> float | None:
        """The attention scores' soft cap (Gemma-2's attn_logit_softcapping); None: none."""
        return None

    def qkv_bias(self, hf_config) -> bool:
        return config_bias(hf_config, "attention_bias")

    def o_proj_bias(self, hf_config) -> bool:
        return config_bias(hf_config, "attention_bias")

    def split_qkv(self, x: torch.Tensor):
        qkv = self.qkv_proj(x)  # [T, (nh + 2 nkv) * hd]
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split_qkv(x)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention
    mlp_cls = LlamaMLP
    norm_cls = RMSNorm
    eps_field = "rms_norm_eps"  # the config field of the norms' epsilon (StarCoder2: norm_epsilon)

    def __init__(self, hf_config, prefix: str):
        super().__init__()
        self.self_attn = self.attention_cls(hf_config, prefix=f"{prefix}.self_attn")
        self.mlp = self.mlp_cls(hf_config, prefix=f"{prefix}.mlp")
        eps = getattr(hf_config, self.eps_field)
        self.input_layernorm = self.norm_cls(hf_config.hidden_size, eps)
        self.post_attention_layernorm = self.norm_cls(hf_config.hidden_size, eps)

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaStyleModel(nn.Module):
    """Embedding, decoder layers, final norm: forward(input_ids [T], positions [T]) -> [T, H].

    Under pipeline parallelism a stage holds its share of the layers; a stage after the first
    takes the previous one's (hidden, residual) and a stage before the last returns them."""
    layer_cls = LlamaDecoderLayer

    def __init__(self, *, kiln_config, prefix: str = "model"):
        super().__init__()
        cfg = kiln_config.model_config.hf_config
        pp = get_pp_group()
        self.is_first_stage, self.is_last_stage = pp.is_first_rank, pp.is_last_rank
        self.start_layer, self.end_layer = this_stage_layer_range(cfg.num_hidden_layers)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) \
            if self.is_first_stage else PPMissingLayer()
        self.layers = nn.ModuleList(
            self.layer_cls(cfg, prefix=f"{prefix}.layers.{i}")
            if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i in range(cfg.num_hidden_layers))
        self.norm = self.layer_cls.norm_cls(cfg.hidden_size,
                                            getattr(cfg, self.layer_cls.eps_field)) \
            if self.is_last_stage \
            else PPMissingLayer()
        share_rotary_embeddings(self.layers)  # one cos/sin cache, not one per layer
        # EAGLE-3: the layers whose input states (num_layers: the last one's output) forward
        # also returns, concatenated; set before the first (tracing) call, () when off
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        # --quantization-rotation: the residual stream carried as h Q ([H, H], set at load by
        # kiln/model/residual_rotation.py, None when off), and Q^T diag(final norm's weight),
        # which compute_logits applies to the rows it is given (not to every prefill row)
        self.register_buffer("residual_rotation", None, persistent=False)
        self.register_buffer("residual_unrotation", None, persistent=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first stage's input hidden states [T, H] (Granite and Gemma scale them)."""
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor | None = None,
                residual: torch.Tensor | None = None):
        if self.is_first_stage:
            hidden, residual = self.embed(input_ids), None
            if self.residual_rotation is not None:  # a Python test: traced away when off
                hidden = hidden @ self.residual_rotation
        else:
            hidden = hidden_states  # [T, H] from the previous stage, with its residual
        aux = []
        for i in range(self.start_layer, self.end_layer):
            if i in self.aux_hidden_state_layers:  # a Python test: traced away when off
                aux.append(hidden if residual is None else hidden + residual)
            hidden, residual = self.layers[i](positions, hidden, residual)
        if not self.is_last_stage:
            return hidden, residual
        hidden, prenorm = self.norm(hidden, residual)
        if not self.aux_hidden_state_layers:
            return hidden
        if len(self.layers) in self.aux_hidden_state_layers:
            aux.append(prenorm)
        return hidden, torch.cat(aux, dim=-1)  # [T, H], [T, len(aux) * H]


@support_torch_compile
class LlamaModel(LlamaStyleModel):
    pass


class LlamaStyleForCausalLM(HFWeightLoading, nn.Module):
    """Backbone + LM head, with HF-name weight loading into the merged parameters
    (kiln/model/hf_weight_loading.py)."""
    model_cls = LlamaModel
    has_lm_head = True  # a classifier (kiln/model/seq_cls.py) has a score head instead
    require_all_weights = True  # load_weights refuses a checkpoint that leaves one out
    lm_head_bias = False  # Phi's head carries a bias

    def __init__(self, *, kiln_config, prefix: str = ""):
        super().__init__()
        cfg = kiln_config.model_config.hf_config
        self.config = cfg
        self.model = self.model_cls(kiln_config=kiln_config, prefix="model")
        self.tie_word_embeddings = self.has_lm_head and bool(
            getattr(cfg, "tie_word_embeddings", False))
        if self.has_lm_head:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size,
                                          bias=self.lm_head_bias) \
                if self.model.is_last_stage else PPMissingLayer()
        # A tied head on a last stage without the embedding loads the embedding's tensor.
        self.head_loads_embedding = self.tie_word_embeddings and not self.model.is_first_stage \
            and self.model.is_last_stage
        if self.tie_word_embeddings and self.model.is_first_stage and self.model.is_last_stage:
            self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor | None = None,
                residual: torch.Tensor | None = None):
        if hidden_states is None:
            return self.model(input_ids, positions)
        return self.model(input_ids, positions, hidden_states, residual)

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        """Make forward return (hidden, the listed layers' input states concatenated) for an
        EAGLE-3 head (kiln/config/eagle3_config.py aux_layer_ids; before the first call)."""
        self.model.aux_hidden_state_layers = tuple(layers)

    def owns(self, name: str) -> bool:
        """Whether a checkpoint tensor belongs to this pipeline stage."""
        if name.startswith("model.layers."):
            index = name.split(".")[2]
            if not index.isdigit():  # no layer's (model.layers.extra.weight): refused as
                return True           # unexpected, not an int() traceback
            index = int(index)
            # A layer past the config's count is no stage's: it is refused as unexpected.
            return (self.model.start_layer <= index < self.model.end_layer
                    or index >= len(self.model.layers))
        if name.startswith("model.embed_tokens."):
            return self.model.is_first_stage or self.head_loads_embedding
        if name.startswith(("model.norm.", "lm_head.")):
            return self.model.is_last_stage
        return True

    # A family whose checkpoint names its tensors otherwise (GPT-NeoX, Phi): (pattern, Kiln's
    # name part) rules applied on load, and Kiln's module name part -> the checkpoint's (what a
    # quantization_config's ignore list names)
    checkpoint_renames: tuple[tuple[re.Pattern, str], ...] = ()
    checkpoint_module_names: tuple[tuple[str, str], ...] = ()

    def kiln_name(self, name: str) -> str:
        for pattern, replacement in self.checkpoint_renames:
            name = pattern.sub(replacement, name)
        return name

    def checkpoint_module_name(self, name: str) -> str:
        for ours, theirs in self.checkpoint_module_names:
            name = name.replace(ours, theirs)
        return name

    def kiln_named(self, weights: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under Kiln's names (lm_head., model.layers. ...): what
        load_weights and a wrapper (the classifier, seq_cls.py) read them by; the names must
        map to themselves again."""
        if not self.checkpoint_renames:
            return weights
        return ((self.kiln_name(name), tensor) for name, tensor in weights)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self.kiln_named(weights))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        unrotation = getattr(self.model, "residual_unrotation", None)
        if unrotation is not None:  # forward's output is normed in the rotated basis
            hidden = hidden @ unrotation
        return self.lm_head.compute_logits(hidden)  # [N, V] float32


class LlamaForCausalLM(LlamaStyleForCausalLM):
    model_cls = LlamaModel
