"""HF-name weight loading for the decoder models: each checkpoint tensor into its (merged,
sharded) parameter, refusing a tensor that fits none and a checkpoint that leaves one out; an
fp8 KV cache's scales (k_scale / v_scale) into their attention layer, where the model's
quantization method reads them (vLLM's rule, kv_cache_scales.py).

A mixin of LlamaStyleForCausalLM, which gives `config`, `model`, `owns`,
`tie_word_embeddings`, `head_loads_embedding` and `require_all_weights`.
"""
from collections.abc import Iterable

import torch

from kiln.attention.kv_cache_scales import (
    default_scale_warning,
    kv_scale_target,
    unplaced_scales_warning,
    unread_scales_warning,
)
from kiln.errors import ConfigError
from kiln.logger import init_logger
from kiln.model.checkpoint_names import (
    checkpoint_parts,
    merged_target,
    split_fused_experts,
    unexpected_tensor_message,
)

logger = init_logger(__name__)


class HFWeightLoading:
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; raises naming any tensor that fits no parameter and any
        parameter the checkpoint did not provide (random weights must never be served), unless
        `require_all_weights` is off: a weight update (kiln/worker/weight_update.py) may bring
        a few. Returns the parts loaded (`name` or `name#shard`; a KV cache scale as its
        layer's `X.attn.k_scale`, as vLLM's parameter is named)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        stored_head = None
        attention = None  # module name -> Attention layer, found at the first KV scale
        unplaced: list[tuple[str, str]] = []  # KV scales for a layer the model lacks
        unread: list[tuple[str, str | None]] = []  # KV scales, and the method not reading them
        for name, tensor in _each_expert_apart(weights):
            if "rotary_emb.inv_freq" in name:
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                stored_head = tensor  # some tied checkpoints still store the head
                continue
            if not self.owns(name):
                continue  # another pipeline stage's
            if self.head_loads_embedding and name == "model.embed_tokens.weight":
                name = "lm_head.weight"
            scale = kv_scale_target(name)
            if scale is not None:
                if attention is None:
                    attention = _attention_layers(self)
                layer = attention.get(scale[0])
                if layer is not None and not layer.reads_checkpoint_scales:
                    unread.append((name, layer.quantization))
                elif layer is not None:  # reported as vLLM names its parameter: X.attn.k_scale
                    loaded.update(f"{scale[0]}.{kind}_scale"
                                  for kind in layer.load_kv_scale(name, scale[1], tensor))
                else:  # skipped with a warning, as vLLM does (maybe_remap_kv_scale_name)
                    unplaced.append((name, scale[0]))
                continue
            target, shard_id = merged_target(name)
            if target not in params:
                if name.endswith(".weight_zero_point") and not tensor.any():
                    continue  # symmetric weights' zero points, all 0 (older llm-compressor)
                raise ConfigError(unexpected_tensor_message(name, self.config))
            param = params[target]
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                raise ValueError(f"parameter {target} has no weight_loader")
            try:
                if shard_id is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard_id)
            except ConfigError as e:  # the checkpoint does not fit the config
                raise ConfigError(f"checkpoint tensor {name}: {e}") from None
            except ValueError as e:  # a loader's bug: keep where it came from
                raise ValueError(f"checkpoint tensor {name}: {e}") from e
            loaded.add(target if shard_id is None else f"{target}#{shard_id}")
        if unplaced:
            logger.warning(unplaced_scales_warning(unplaced))
        if unread:
            logger.warning(unread_scales_warning([n for n, _ in unread], unread[0][1]))
        if self.require_all_weights:  # a whole model's load
            self._check_complete(params, loaded)
            self._warn_default_kv_scales(attention or _attention_layers(self))
        if stored_head is not None:
            self._warn_if_head_differs(stored_head)
        return loaded

    def _warn_default_kv_scales(self, attention: dict) -> None:
        """Once per load: layers reading checkpoint KV scales (Attention.reads_checkpoint_scales)
        whose fp8 cache got none run at 1.0 (default_scale_warning)."""
        reading = [layer for layer in attention.values() if layer.reads_checkpoint_scales]
        if not reading:
            return
        unscaled = sum(1 for layer in reading if not {"k", "v"} & layer.checkpoint_scales.keys())
        warning = default_scale_warning(reading[0].kv_cache_dtype, unscaled, len(attention),
                                        getattr(self.config, "quantization_config", None))
        if warning is not None:
            logger.warning(warning)

    def _warn_if_head_differs(self, stored_head: torch.Tensor) -> None:
        """A tied checkpoint whose stored head is not its embedding: Kiln ties them, as vLLM
        does; transformers 5 unties them and uses the stored head, so outputs differ."""
        embedding = getattr(self.model.embed_tokens, "weight", None)
        if (embedding is None or embedding.is_meta or embedding.shape != stored_head.shape
                or torch.equal(stored_head.to(embedding.dtype), embedding.data)):
            return
        logger.warning("tie_word_embeddings is true but the checkpoint's lm_head.weight differs "
                       "from model.embed_tokens.weight: Kiln uses the embedding as the head (as "
                       "vLLM does); transformers 5 uses the stored head. Set "
                       "tie_word_embeddings false in config.json to serve the stored head")

    def _check_complete(self, params: dict, loaded: set[str]) -> None:
        missing = self.missing_weights(loaded, params)
        if missing:
            raise ConfigError(f"checkpoint is missing {len(missing)} parameter(s): "
                              f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")

    def missing_weights(self, loaded: set[str], params: dict | None = None) -> list[str]:
        """The parameters (and shards) a checkpoint must give that `loaded` lacks."""
        if params is None:
            params = dict(self.named_parameters(remove_duplicate=False))
        missing = []
        for name, param in params.items():
            if self.tie_word_embeddings and name == "lm_head.weight" \
                    and not self.head_loads_embedding:
                continue
            if getattr(param, "optional_in_checkpoint", False):  # a check only (GPTQ's g_idx)
                continue
            # stacked experts (kiln/model/layers/fused_moe.py) name their own parts
            shards = getattr(param, "shard_ids", None)
            parts = [(name, s) for s in shards] if shards else checkpoint_parts(name)
            for _, shard in parts:
                if shard is None and name not in loaded:
                    missing.append(name)
                elif shard is not None and f"{name}#{shard}" not in loaded:
                    missing.append(f"{name} (shard {shard})")
        return missing


def _attention_layers(model: torch.nn.Module) -> dict:
    """The model's Attention layers by module name (where the checkpoint's KV scales go)."""
    from kiln.model.layers.attention import Attention

    return {n: m for n, m in model.named_modules() if isinstance(m, Attention)}


def _each_expert_apart(weights: Iterable[tuple[str, torch.Tensor]]):
    """The checkpoint's tensors, a fused expert tensor (transformers 5's layout) as each
    expert's own (split_fused_experts)."""
    for name, tensor in weights:
        experts = split_fused_experts(name, tensor)
        if experts is None:
            yield name, tensor
        else:
            yield from experts
