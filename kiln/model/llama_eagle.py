"""EAGLE-1's draft head for Llama-family targets (vLLM's EagleLlamaForCausalLM): `fc` folds each
token's embedding with the target's last hidden state at the position before it, then
num_hidden_layers Llama decoder layers (the first without its input norm), no final norm.

The head owns neither embedding nor LM head: it reads the target's (share_target), as vLLM's
does. A checkpoint's names are EAGLE's (`fc.weight`, `layers.0...`), with or without `model.`;
a stored embed_tokens / lm_head copy is the target's and skipped.
"""
import torch
from torch import nn

from kiln.compilation.decorator import support_torch_compile
from kiln.errors import ConfigError
from kiln.model.hf_weight_loading import HFWeightLoading
from kiln.model.layers.linear import ReplicatedLinear
from kiln.model.layers.rotary_embedding import share_rotary_embeddings
from kiln.model.llama import LlamaDecoderLayer


@support_torch_compile
class EagleLlamaModel(nn.Module):
    def __init__(self, *, kiln_config, prefix: str = "model"):
        super().__init__()
        cfg = kiln_config.model_config.hf_config
        # EAGLE's own heads train fc with a bias, vLLM's class has none: taken when the
        # checkpoint has one, else zero (EagleLlamaForCausalLM.load_weights)
        self.fc = ReplicatedLinear(2 * cfg.hidden_size, cfg.hidden_size, True)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, prefix=f"{prefix}.layers.{i}")
                                    for i in range(cfg.num_hidden_layers))
        # the fc output is the layer's input as it is (EAGLE's cnets.py skips this norm)
        self.layers[0].input_layernorm = nn.Identity()
        share_rotary_embeddings(self.layers)
        self._embed: tuple = ()  # (the target's embed_tokens,), kept out of this module tree

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                target_hidden: torch.Tensor) -> torch.Tensor:
        embeds = self._embed[0](input_ids)  # [T, H]
        hidden = self.fc(torch.cat((embeds, target_hidden.to(embeds.dtype)), dim=-1))  # [T, H]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return hidden + residual  # [T, H]: the next position's "target hidden" too


class EagleLlamaForCausalLM(HFWeightLoading, nn.Module):
    tie_word_embeddings = False
    head_loads_embedding = False
    require_all_weights = True

    def __init__(self, *, kiln_config, prefix: str = ""):
        super().__init__()
        self.config = kiln_config.model_config.hf_config
        self.model = EagleLlamaModel(kiln_config=kiln_config, prefix="model")
        self._lm_head: tuple = ()

    def share_target(self, target: nn.Module) -> None:
        """Read the target's token embedding and LM head (a Llama-style CausalLM's)."""
        inner = getattr(target, "model", None)
        embed, head = getattr(inner, "embed_tokens", None), getattr(target, "lm_head", None)
        if embed is None or head is None or not hasattr(head, "compute_logits"):
            raise ConfigError("--speculative-config: method='eagle' needs a target with its "
                              "own token embedding and LM head (model.embed_tokens, lm_head)")
        self.model._embed, self._lm_head = (embed,), (head,)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                target_hidden: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, target_hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._lm_head[0].compute_logits(hidden)  # [N, V] float32

    def owns(self, name: str) -> bool:
        return True

    def load_weights(self, weights) -> set[str]:
        loaded = super().load_weights(
            (name, tensor) for name, tensor in
            ((_kiln_name(n), t) for n, t in weights) if name is not None)
        if _FC_BIAS not in loaded:
            self.model.fc.bias.data.zero_()
        return loaded

    def missing_weights(self, loaded: set[str], params: dict | None = None) -> list[str]:
        return [name for name in super().missing_weights(loaded, params) if name != _FC_BIAS]


_FC_BIAS = "model.fc.bias"


def _kiln_name(name: str) -> str | None:
    """EAGLE's checkpoint name -> this module's; None for the target's own tensors."""
    bare = name.removeprefix("model.")
    if bare.startswith(("embed_tokens.", "lm_head.")):
        return None
    return f"model.{bare}"
