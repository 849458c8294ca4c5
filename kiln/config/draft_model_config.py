"""The draft model's ModelConfig under --speculative-config method='draft_model' (or the EAGLE
head's, method='eagle' / 'eagle3': eagle_config.py, eagle3_config.py), built from the target's
(dtype, seed, load format; its length capped as vLLM's), and the checks that it can draft for
it."""
from kiln.config.model_config import ModelConfig
from kiln.errors import ConfigError

_FLAG = "--speculative-config"


def resolve_draft_model_config(spec, target: ModelConfig) -> None:
    """Set spec.draft_model_config (once: a config re-resolved keeps it)."""
    if spec is not None and target.runner_type != "generate":
        # every method drafts generated tokens: an n-gram config was accepted and did nothing
        raise ConfigError(f"{_FLAG} (method={spec.method!r}) drafts generated tokens, and "
                          f"--runner {target.runner_type} (--task embed / classify / score) "
                          f"generates none; drop {_FLAG} or --runner {target.runner_type}")
    if spec is None or not spec.runner_proposes or spec.draft_model_config is not None:
        return
    if spec.is_eagle:
        from kiln.config.eagle3_config import eagle3_model_config
        from kiln.config.eagle_config import eagle_model_config

        draft = (eagle_model_config if spec.method == "eagle" else eagle3_model_config)(
            spec, target)
        draft.max_model_len = draft_max_model_len(draft.max_model_len, target.max_model_len,
                                                  spec.max_model_len)
        draft.freeze()
        object.__setattr__(spec, "draft_model_config", draft)
        return
    try:
        # its own length first (None: the model's), then capped (draft_max_model_len)
        draft = ModelConfig(model=spec.model, dtype=target.torch_dtype,
                            max_model_len=None, seed=target.seed,
                            load_format="dummy" if target.load_format == "dummy" else "auto",
                            revision=spec.revision, download_dir=target.download_dir,
                            skip_tokenizer_init=True, generation_config="vllm",
                            max_logprobs=target.max_logprobs)
    except (ConfigError, FileNotFoundError, OSError) as e:
        raise ConfigError(f"{_FLAG}: draft model speculative_config.model={spec.model!r}: "
                          f"{e}") from None
    check_draft_fits(draft, target)
    draft.max_model_len = draft_max_model_len(draft.max_model_len, target.max_model_len,
                                              spec.max_model_len)
    draft.freeze()
    object.__setattr__(spec, "draft_model_config", draft)


def draft_max_model_len(draft_own: int, target: int, asked: int | None) -> int:
    """The longest sequence the draft drafts for, as vLLM caps it: the least of its own length,
    the target's max_model_len and speculative_config.max_model_len. A request past it goes on
    without drafts (DraftModelProposer.plan)."""
    return min(draft_own, target, asked or target)


def check_draft_fits(draft: ModelConfig, target: ModelConfig) -> None:
    """The draft proposes token ids the target verifies: one vocabulary for both, and an LM
    head to propose them with (a classifier's score head has none: its first step killed the
    engine core)."""
    from kiln.pooling.pooling_task import is_seq_cls

    if is_seq_cls(draft.architecture):
        raise ConfigError(f"{_FLAG}: the draft model {draft.model!r} is a {draft.architecture} "
                          "(a score head, no LM head) and cannot propose tokens; give "
                          "speculative_config.model a *ForCausalLM checkpoint of the target's "
                          "family")
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"{_FLAG}: the draft model {draft.model!r} has vocab_size="
                          f"{draft.vocab_size} and the target {target.model!r} "
                          f"{target.vocab_size}; a draft model must share the target's "
                          "tokenizer and vocabulary (pick one of the target's family)")
