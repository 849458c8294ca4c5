"""The EAGLE head's ModelConfig under --speculative-config method='eagle': its config.json read
as an EagleLlamaForCausalLM, and the checks that it can draft for the target (kiln/model/
llama_eagle.py shares the target's embedding and LM head, so their sizes must be one). The
helpers that read a head's directory serve EAGLE-3's too (eagle3_config.py)."""
from kiln.config.hf_config_snapshot import HFConfigSnapshot, load_hf_dir_config
from kiln.config.model_config import ModelConfig
from kiln.errors import ConfigError

_FLAG = "--speculative-config"
EAGLE_ARCHITECTURE = "EagleLlamaForCausalLM"
# the names an EAGLE-1 Llama head's config.json gives itself (yuhuili's say LlamaForCausalLM)
_HEAD_ARCHITECTURES = ("EagleLlamaForCausalLM", "EAGLELlamaForCausalLM", "LlamaForCausalLM")
# targets whose embedding and LM head an EAGLE Llama head can share as they are (no embedding
# scale, no logit soft cap), and whose backbone hands out EAGLE-3's auxiliary hidden states
_TARGETS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def read_head_config(spec, target: ModelConfig):
    """(the head's directory, its config.json, the phrase errors start with), after checking
    that the target is one an EAGLE head drafts for."""
    from kiln.model.loader.hub import resolve_path

    where = f"{_FLAG}: EAGLE head speculative_config.model={spec.model!r}"
    if target.architecture not in _TARGETS:
        raise ConfigError(f"{_FLAG}: method={spec.method!r} drafts for {', '.join(_TARGETS)} "
                          f"targets; the target is {target.architecture} (use "
                          "method='draft_model' or 'ngram' with it)")
    try:
        path = resolve_path(spec.model, revision=spec.revision,
                            download_dir=target.download_dir)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} holds no config.json (an EAGLE head is a "
                                    "directory with config.json and its weights)")
        head = load_hf_dir_config(path)
    except (ConfigError, FileNotFoundError, OSError) as e:
        raise ConfigError(f"{where}: {e}") from None
    return path, head, where


def head_model_config(path, head, architecture: str, target: ModelConfig,
                      where: str) -> ModelConfig:
    """The head's ModelConfig as `architecture`, with the target's dtype and seed; its length its
    own (resolve_draft_model_config caps it: a head shorter than the target drafts for shorter
    requests only, as a draft model does)."""
    values = {**head.to_dict(), "architectures": [architecture]}
    try:
        config = ModelConfig(model=str(path), hf_config=HFConfigSnapshot(values),
                             dtype=target.torch_dtype, max_model_len=None,
                             seed=target.seed,
                             load_format="dummy" if target.load_format == "dummy" else "auto",
                             skip_tokenizer_init=True, generation_config="vllm",
                             max_logprobs=target.max_logprobs)
    except (ConfigError, FileNotFoundError, OSError) as e:
        raise ConfigError(f"{where}: {e}") from None
    if config.quant_kind is not None:  # one quantizing only its KV cache has float linears
        raise ConfigError(f"{where}: a quantized EAGLE head ({config.quantization}) is not "
                          "served; use its float checkpoint")
    return config


def eagle_model_config(spec, target: ModelConfig) -> ModelConfig:
    """The head's ModelConfig, checked against the target's."""
    path, head, where = read_head_config(spec, target)
    archs = list(getattr(head, "architectures", None) or [])
    if not archs or archs[0] not in _HEAD_ARCHITECTURES:
        from kiln.config.eagle3_config import HEAD_ARCHITECTURES as EAGLE3

        hint = ("; an EAGLE-3 head runs under method='eagle3'" if archs and archs[0] in EAGLE3
                else "")
        raise ConfigError(f"{where}: architectures {archs} is not an EAGLE-1 Llama head (Kiln "
                          f"takes {', '.join(_HEAD_ARCHITECTURES)}){hint}")
    if getattr(head, "add_para_norm", False):
        raise ConfigError(f"{where}: a HASS head (add_para_norm: norms before fc) is not "
                          "served; an EAGLE-1 head is")
    check_head_fits(head, target, where)
    return head_model_config(path, head, EAGLE_ARCHITECTURE, target, where)


def check_head_fits(head, target: ModelConfig, where: str) -> None:
    """The head reads the target's token embeddings and last hidden states and writes through
    its LM head: one hidden size and one vocabulary for both."""
    for name, want in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
        got = getattr(head, name, None)
        if got != want:
            raise ConfigError(f"{where} has {name}={got} and the target {target.model!r} "
                              f"{want}; an EAGLE head must be trained for its target (same "
                              f"{name}): pick the head made for this model")
