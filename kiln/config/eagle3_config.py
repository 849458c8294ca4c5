"""The EAGLE-3 head's ModelConfig under --speculative-config method='eagle3' (read as an
Eagle3LlamaForCausalLM: kiln/model/llama_eagle3.py), the checks that it can draft for the target,
and which of the target's layers hand it their hidden states (aux_layer_ids)."""
from kiln.config.eagle_config import head_model_config, read_head_config
from kiln.config.model_config import ModelConfig
from kiln.errors import ConfigError

EAGLE3_ARCHITECTURE = "Eagle3LlamaForCausalLM"
# the names an EAGLE-3 Llama head's config.json gives itself (yuhuili's: LlamaForCausalLMEagle3)
HEAD_ARCHITECTURES = ("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3")
# fc folds this many of the target's layers (vLLM's fc takes 3 * hidden_size)
NUM_AUX_LAYERS = 3


def eagle3_model_config(spec, target: ModelConfig) -> ModelConfig:
    """The head's ModelConfig, checked against the target's."""
    path, head, where = read_head_config(spec, target)
    archs = list(getattr(head, "architectures", None) or [])
    if not archs or archs[0] not in HEAD_ARCHITECTURES:
        raise ConfigError(f"{where}: architectures {archs} is not an EAGLE-3 Llama head (Kiln "
                          f"takes {', '.join(HEAD_ARCHITECTURES)}); an EAGLE-1 head runs under "
                          "method='eagle'")
    eagle = getattr(head, "eagle_config", None) or {}
    if isinstance(eagle, dict) and eagle.get("use_aux_hidden_state", True) is False:
        raise ConfigError(f"{where}: eagle_config.use_aux_hidden_state=false (a head reading "
                          "the target's last hidden state alone) is not served; an EAGLE-3 "
                          "head that folds 3 of the target's layers is")
    # vLLM's target_hidden_size: the width of the target states fc reads (the head's own
    # hidden_size may differ; unset, it is the head's)
    width = ("target_hidden_size" if getattr(head, "target_hidden_size", None) is not None
             else "hidden_size")
    for name, want in ((width, target.hidden_size), ("vocab_size", target.vocab_size)):
        got = getattr(head, name, None)
        if got != want:
            raise ConfigError(f"{where} has {name}={got} and the target {target.model!r} "
                              f"{want}; an EAGLE-3 head must be trained for its target (same "
                              f"{name}; a head of another width names the target's in "
                              "target_hidden_size): pick the head made for this model")
    layers = getattr(head, "num_hidden_layers", None)
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ConfigError(f"{where} has num_hidden_layers={layers!r}; an EAGLE-3 head has at "
                          "least its one decoder layer (1)")
    draft_vocab = getattr(head, "draft_vocab_size", None)
    if draft_vocab is not None and (isinstance(draft_vocab, bool) or not isinstance(
            draft_vocab, int) or not 0 < draft_vocab <= target.vocab_size):
        raise ConfigError(f"{where} has draft_vocab_size={draft_vocab!r}; it must be an "
                          f"integer in [1, vocab_size={target.vocab_size}] (the head's own "
                          "vocabulary, a subset of the target's)")
    aux_layer_ids(head, target.num_layers, where)  # refused now, not when the model loads
    return head_model_config(path, head, EAGLE3_ARCHITECTURE, target, where)


def aux_layer_ids(head, num_layers: int, where: str = "EAGLE-3 head") -> tuple[int, ...]:
    """The target layers whose input hidden states (pre-norm; num_layers: the last layer's
    output) fc folds, in layer order as vLLM concatenates them: the head config's
    eagle_aux_hidden_state_layer_ids (or eagle_config's), else vLLM's default (2, L // 2,
    L - 3)."""
    field = "eagle_aux_hidden_state_layer_ids"
    ids = getattr(head, field, None)
    eagle = getattr(head, "eagle_config", None)
    if not ids and isinstance(eagle, dict) and eagle.get(field):
        ids, field = eagle[field], f"eagle_config.{field}"
    if not ids:
        ids, field = (2, num_layers // 2, num_layers - 3), "the default layers (2, L//2, L-3)"
    if not isinstance(ids, (list, tuple)) or any(
            isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ConfigError(f"{where}: {field} must be a list of layer indices, got {ids!r}")
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        raise ConfigError(f"{where}: {field} {list(ids)} name layer(s) {bad} outside the "
                          f"target's 0..{num_layers} (it has {num_layers} layers); set "
                          f"{'eagle_aux_hidden_state_layer_ids'} in the head's config.json to "
                          "the layers it was trained on")
    unique = tuple(sorted(set(ids)))
    if len(unique) != NUM_AUX_LAYERS:
        raise ConfigError(f"{where}: {field} {list(ids)} name {len(unique)} distinct layer(s); "
                          f"an EAGLE-3 head's fc folds {NUM_AUX_LAYERS}")
    return unique


def target_aux_layer_ids(kiln_config) -> tuple[int, ...]:
    """The target layers whose hidden states the model runner hands an EAGLE-3 head; () without
    one (the target's graph then outputs its last hidden states alone)."""
    spec = kiln_config.speculative_config
    if spec is None or spec.method != "eagle3" or spec.draft_model_config is None:
        return ()
    return aux_layer_ids(spec.draft_model_config.hf_config, kiln_config.model_config.num_layers)
