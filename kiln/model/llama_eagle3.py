"""EAGLE-3's draft head for Llama-family targets (vLLM's Eagle3LlamaForCausalLM): `fc` folds the
target's hidden states from 3 of its layers into one; the first decoder layer attends over
[input_layernorm(token embedding) | hidden_norm(that state)] (2 * hidden wide); a final `norm`
and the head's own LM head over its draft vocabulary, whose ids `d2t` maps to the target's.

The forward returns the pre-norm state (the next draft's input, as vLLM's hidden_prenorm);
compute_logits norms it. A checkpoint without embed_tokens reads the target's embedding, one
without lm_head (draft_vocab_size == vocab_size only) the target's head (share_target).
Checkpoint names are EAGLE's (`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`; `t2d` unused),
with or without `model.`, or `layers.0.*`.
"""
import torch
from torch import nn

from kiln.compilation.decorator import support_torch_compile
from kiln.errors import ConfigError
from kiln.model.hf_weight_loading import HFWeightLoading
from kiln.model.layers.layernorm import RMSNorm
from kiln.model.layers.linear import QKVParallelLinear, ReplicatedLinear
from kiln.model.layers.rotary_embedding import share_rotary_embeddings
from kiln.model.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from kiln.model.llama import LlamaDecoderLayer

_WHERE = "--speculative-config: EAGLE-3 head"


class Eagle3FirstLayer(LlamaDecoderLayer):
    """A Llama layer whose attention reads [normed embedding | normed hidden state]."""

    def __init__(self, hf_config, prefix: str):
        super().__init__(hf_config, prefix)
        h, attn = hf_config.hidden_size, self.self_attn
        heads = hf_config.num_attention_heads
        attn.qkv_proj = QKVParallelLinear(
            2 * h, attn.head_dim, heads, getattr(hf_config, "num_key_value_heads", None) or heads,
            attn.qkv_bias(hf_config))
        self.hidden_norm = RMSNorm(h, hf_config.rms_norm_eps)
        # some heads were trained with the residual taken after hidden_norm
        self.norm_before_residual = bool(getattr(hf_config, "norm_before_residual", False))

    def forward(self, positions, embeds, hidden):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)  # [T, 2H]
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


@support_torch_compile
class Eagle3LlamaModel(nn.Module):
    def __init__(self, *, kiln_config, prefix: str = "model"):
        super().__init__()
        from kiln.config.eagle3_config import NUM_AUX_LAYERS

        cfg = kiln_config.model_config.hf_config
        h = cfg.hidden_size
        # vLLM's target_hidden_size: a head narrower or wider than its target folds the
        # target's states into its own width
        self.fc = ReplicatedLinear(NUM_AUX_LAYERS * target_hidden_size(cfg), h, False)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, h)
        self.layers = nn.ModuleList(
            (Eagle3FirstLayer if i == 0 else LlamaDecoderLayer)(cfg, prefix=f"{prefix}.layers.{i}")
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        share_rotary_embeddings(self.layers)
        self._embed: tuple = ()  # (the target's embed_tokens,) where the checkpoint has none

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor) -> torch.Tensor:
        embed = self._embed[0] if self._embed else self.embed_tokens
        embeds = embed(input_ids)  # [T, H]
        hidden, residual = self.layers[0](positions, embeds, hidden.to(embeds.dtype))
        for layer in self.layers[1:]:
            hidden, residual = layer(positions, hidden, residual)
        return hidden + residual  # [T, H] pre-norm: the next draft's hidden state


class Eagle3LlamaForCausalLM(HFWeightLoading, nn.Module):
    tie_word_embeddings = False
    head_loads_embedding = False
    require_all_weights = True

    def __init__(self, *, kiln_config, prefix: str = ""):
        super().__init__()
        cfg = self.config = kiln_config.model_config.hf_config
        self.vocab_size = cfg.vocab_size
        self.draft_vocab_size = getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size
        self.model = Eagle3LlamaModel(kiln_config=kiln_config, prefix="model")
        self.lm_head = ParallelLMHead(self.draft_vocab_size, cfg.hidden_size)
        self.d2t = nn.Parameter(torch.zeros(self.draft_vocab_size, dtype=torch.int64),
                                requires_grad=False)
        self.d2t.weight_loader = self._load_d2t
        # what the checkpoint brought (a dummy load: neither, so the target's are read)
        self.has_own_embed = self.has_own_lm_head = False
        self._lm_head: tuple = ()  # (the target's lm_head,) where the checkpoint has none
        self._draft_to_target: torch.Tensor | None = None  # set by share_target

    def share_target(self, target: nn.Module) -> None:
        """Read the target's token embedding and LM head where the checkpoint has none."""
        inner = getattr(target, "model", None)
        embed, head = getattr(inner, "embed_tokens", None), getattr(target, "lm_head", None)
        own_width = target_hidden_size(self.config) == self.config.hidden_size
        if not self.has_own_embed:
            if not own_width:
                raise ConfigError(f"{_WHERE}: its hidden_size={self.config.hidden_size} "
                                  "differs from the target's (target_hidden_size="
                                  f"{target_hidden_size(self.config)}) and its checkpoint has no "
                                  "embed_tokens, so the target's embedding cannot stand in; use "
                                  "the head's full checkpoint")
            if embed is None:
                raise ConfigError(f"{_WHERE}: its checkpoint has no embed_tokens and the target "
                                  "has no model.embed_tokens to share")
            self.model.embed_tokens, self.model._embed = None, (embed,)
        if not self.has_own_lm_head:
            if not own_width:
                raise ConfigError(f"{_WHERE}: its hidden_size={self.config.hidden_size} "
                                  "differs from the target's and its checkpoint has no "
                                  "lm_head.weight, so the target's LM head cannot stand in; use "
                                  "the head's full checkpoint")
            if self.draft_vocab_size != self.vocab_size:
                raise ConfigError(f"{_WHERE}: its checkpoint has no lm_head.weight, and its "
                                  f"draft_vocab_size={self.draft_vocab_size} differs from the "
                                  f"target's vocab_size={self.vocab_size}, so the target's LM "
                                  "head cannot stand in; use a checkpoint with its lm_head")
            if head is None or not hasattr(head, "compute_logits"):
                raise ConfigError(f"{_WHERE}: its checkpoint has no lm_head and the target has "
                                  "no lm_head to share")
            self.lm_head, self._lm_head = None, (head,)
        self._map_draft_ids()

    def _map_draft_ids(self) -> None:
        """The target id of each draft id from d2t, read once per load (not a device sync per
        draft); None: draft ids are target ids."""
        if self.draft_vocab_size == self.vocab_size and not bool(self.d2t.any()):
            self._draft_to_target = None
        else:  # _load_d2t checked the ids
            self._draft_to_target = _draft_to_target(self.d2t.data)

    def _load_d2t(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.is_floating_point() or loaded.shape != param.shape:
            raise ConfigError(f"d2t: expected integer ids of shape {tuple(param.shape)} (one "
                              f"per draft_vocab_size entry), got {loaded.dtype} "
                              f"{tuple(loaded.shape)}")
        # checked before it is written: an update refused leaves the head drafting as it did
        _check_draft_to_target(_draft_to_target(loaded), self.vocab_size)
        param.data.copy_(loaded)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, hidden)

    def combine_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's [T, 3H] auxiliary states -> the first draft's [T, H] input."""
        return self.model.fc(aux.to(self.model.fc.weight.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] pre-norm -> [N, V] float32 over the target's ids (-inf off the draft
        vocabulary), as vLLM's."""
        head = self._lm_head[0] if self._lm_head else self.lm_head
        logits = head.compute_logits(self.model.norm(hidden))  # [N, draft V]
        if self._draft_to_target is None:
            return logits
        out = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        out[:, self._draft_to_target] = logits
        return out

    def owns(self, name: str) -> bool:
        return True

    def load_weights(self, weights) -> set[str]:
        loaded = super().load_weights(
            (name, tensor) for name, tensor in
            ((_kiln_name(n), t) for n, t in weights) if name is not None)
        self.has_own_embed = "model.embed_tokens.weight" in loaded
        self.has_own_lm_head = "lm_head.weight" in loaded
        if "d2t" in loaded:  # an update's d2t maps the drafts from now on
            self._map_draft_ids()
        return loaded

    def missing_weights(self, loaded: set[str], params: dict | None = None) -> list[str]:
        optional = {"model.embed_tokens.weight", "lm_head.weight"}  # the target's stand in
        if self.draft_vocab_size == self.vocab_size:
            optional.add("d2t")  # draft ids are target ids
        return [n for n in super().missing_weights(loaded, params) if n not in optional]

    def _check_complete(self, params: dict, loaded: set[str]) -> None:
        if "d2t" not in loaded and self.draft_vocab_size != self.vocab_size:
            raise ConfigError(f"{_WHERE}: draft_vocab_size={self.draft_vocab_size} differs from "
                              f"vocab_size={self.vocab_size} and its checkpoint has no d2t (the "
                              "draft-to-target token id map); use the head's full checkpoint, "
                              "or one whose draft vocabulary is the target's")
        super()._check_complete(params, loaded)


def target_hidden_size(hf_config) -> int:
    """The width of the target's hidden states the head's fc reads (vLLM's draft config field
    target_hidden_size; the head's own hidden_size when unset)."""
    return getattr(hf_config, "target_hidden_size", None) or hf_config.hidden_size


def _check_draft_to_target(ids: torch.Tensor, vocab_size: int) -> None:
    """Refuse a d2t naming ids outside the target's vocabulary, or one id twice: the first
    failed the first draft step with an IndexError (the engine down, every request with it)."""
    bad = torch.nonzero((ids < 0) | (ids >= vocab_size)).flatten()
    if bad.numel():
        i = int(bad[0])
        raise ConfigError(f"{_WHERE}: its d2t maps draft id {i} to target id {int(ids[i])} "
                          f"({bad.numel()} id(s) outside the target's vocab_size={vocab_size}); "
                          "the head was made for another tokenizer: pick the head made for "
                          "this model")
    if torch.unique(ids).numel() != ids.numel():
        raise ConfigError(f"{_WHERE}: its d2t maps {ids.numel() - torch.unique(ids).numel()} "
                          "draft id(s) onto a target id another draft id has; each draft id "
                          "needs a target id of its own (draft id i is target id i + d2t[i])")


def _draft_to_target(d2t: torch.Tensor) -> torch.Tensor:
    """Draft id i is target id i + d2t[i] (EAGLE-3's own layout): each draft id's target id."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t.to(torch.int64)


def _kiln_name(name: str) -> str | None:
    """EAGLE-3's checkpoint name -> this module's; None for the unused t2d."""
    bare = name.removeprefix("model.")
    if bare == "t2d":
        return None
    if bare in ("d2t", "lm_head.weight"):
        return bare
    if bare.startswith("midlayer."):
        bare = "layers.0." + bare.removeprefix("midlayer.")
    return f"model.{bare}"
