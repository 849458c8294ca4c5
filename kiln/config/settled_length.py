"""The config an engine reports once its core settled max_model_len: where the KV cache holds
fewer tokens than the model's length (auto-fit), the core lowers it, and every view a script
reads (`llm.llm_engine.model_config.max_model_len`, the scheduler config's, `vllm_config`'s;
lm-eval reads the first) must say the length the engine accepts, as vLLM's do once it rewrote
its config (`recalculate_max_model_len`)."""
import copy


def _with_field(config, **values):
    """A copy of a frozen config with `values` set (the original, which the core may share,
    keeps its own)."""
    clone = copy.copy(config)
    for name, value in values.items():
        object.__setattr__(clone, name, value)
    return clone


def with_settled_max_model_len(kiln_config, max_model_len: int):
    """`kiln_config` itself where its max_model_len is the settled one, else a frozen copy
    whose model and scheduler configs say `max_model_len` (the others are shared)."""
    if kiln_config.model_config.max_model_len == max_model_len:
        return kiln_config
    return _with_field(
        kiln_config,
        model_config=_with_field(kiln_config.model_config, max_model_len=max_model_len),
        scheduler_config=_with_field(kiln_config.scheduler_config,
                                     max_model_len=max_model_len))
