"""Whether a model splits over the requested ranks, checked in the engine process before any
rank starts, so a bad -tp / -pp is one clear error naming the model field and the flag.
"""


from kiln.errors import ConfigError


def parallel_split_errors(hf_config, tp: int, pp: int) -> list[str]:
    """Every reason `hf_config` cannot run with tensor_parallel_size tp and
    pipeline_parallel_size pp (empty when it can)."""
    errors = []
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tp:
        errors.append(f"num_attention_heads ({heads}) is not divisible by "
                      f"tensor_parallel_size ({tp})")
    if kv_heads % tp and tp % kv_heads:
        errors.append(f"num_key_value_heads ({kv_heads}) and tensor_parallel_size ({tp}) must "
                      "divide one another (KV heads are split, or replicated past their count)")
    # the dense MLP's, each expert's (a mixture of experts splits every expert), the shared one's
    for field in ("intermediate_size", "moe_intermediate_size",
                  "shared_expert_intermediate_size"):
        inter = getattr(hf_config, field, None) or 0
        if inter % tp:
            errors.append(f"{field} ({inter}) is not divisible by tensor_parallel_size ({tp})")
    layers = hf_config.num_hidden_layers
    if layers < pp:
        errors.append(f"num_hidden_layers ({layers}) is fewer than pipeline_parallel_size "
                      f"({pp}): every stage needs a layer")
    return errors


def check_parallel_split(kiln_config) -> None:
    """The target, and a draft model or EAGLE head (sharded over the target's ranks), split
    over the requested ranks; else one error naming the model, its field and the flag."""
    pc = kiln_config.parallel_config
    tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
    errors = parallel_split_errors(kiln_config.model_config.hf_config, tp, pp)
    if errors:
        raise ConfigError(f"{kiln_config.model_config.architecture} cannot run with "
                          f"--tensor-parallel-size {tp} --pipeline-parallel-size {pp}: "
                          + "; ".join(errors))
    spec = kiln_config.speculative_config
    draft = None if spec is None else spec.draft_model_config
    # (the draft's errors came from a rank's layer build, naming neither the draft nor the flag)
    errors = [] if draft is None else parallel_split_errors(draft.hf_config, tp, 1)
    if errors:
        raise ConfigError(f"--speculative-config: the draft speculative_config.model="
                          f"{spec.model!r} ({draft.architecture}) runs sharded over the target's "
                          f"--tensor-parallel-size {tp} ranks and cannot: " + "; ".join(errors)
                          + f"; pick a draft that splits {tp} ways or lower -tp")
