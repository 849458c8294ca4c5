"""What /openapi.json says the sampling fields of completions and chat take, as the server
checks them: their ranges, the fields only their off value passes, and structured_outputs.
"""
from kiln.entrypoints.openai.openapi_cross_field import NULL


def sampling_ranges(model_schema: dict, max_logprobs: int, vocab_size: int | None = None,
                    max_sequences: int | None = None) -> None:
    """The sampling fields' ranges, as SamplingParams and the engine check them (outside is a
    400); `max_logprobs`: the engine's cap on (top_/prompt_)logprobs; `vocab_size`: what -1
    (the whole vocabulary) asks for, refused above the cap; `max_sequences`: the server's cap
    on prompts x n (--max-sequences-per-request), which bounds n beside
    KILN_MAX_N_SEQUENCES."""
    from kiln.envs import max_n_sequences
    from kiln.repetition_detection import MAX_MIN_COUNT, MAX_PATTERN_SIZE
    from kiln.sampling_params import (
        _INT64,
        _MAX_REPETITION_PENALTY,
        _MAX_TEMPERATURE,
        _MIN_REPETITION_PENALTY,
        MAX_BAD_WORDS_PER_REQUEST,
        MAX_STOP_STRINGS,
        MAX_STOP_TOKEN_IDS,
    )

    whole_vocab = -1 if vocab_size is None or vocab_size <= max_logprobs else 0
    if vocab_size is not None:  # a --max-logprobs past the vocabulary: no more than it holds
        max_logprobs = min(max_logprobs, vocab_size)

    most_n = min(max_n_sequences(), max_sequences or max_n_sequences())  # the variable's, now
    ranges = {"n": {"minimum": 1, "maximum": most_n},
              "temperature": {"minimum": 0, "maximum": _MAX_TEMPERATURE},
              "top_p": {"exclusiveMinimum": 0, "maximum": 1},
              "min_p": {"minimum": 0, "maximum": 1},
              "top_k": {"minimum": -1, "maximum": _INT64[1]},  # what crosses to the core
              "presence_penalty": {"minimum": -2, "maximum": 2},
              "frequency_penalty": {"minimum": -2, "maximum": 2},
              "repetition_penalty": {"minimum": _MIN_REPETITION_PENALTY,
                                     "maximum": _MAX_REPETITION_PENALTY},
              "max_tokens": {"minimum": 1}, "max_completion_tokens": {"minimum": 1},
              "min_tokens": {"minimum": 0},
              # repetition detection's pattern sizes (min <= max: across fields, unstated)
              **{name: {"minimum": 0, "maximum": MAX_PATTERN_SIZE}
                 for name in ("max_repetition_pattern_size", "min_repetition_pattern_size")},
              "repetition_min_count": {"minimum": 0, "maximum": MAX_MIN_COUNT},
              "seed": {"minimum": _INT64[0], "maximum": _INT64[1]},  # torch's 64-bit seeds
              # -1: the whole vocabulary (vLLM's), where max_logprobs allows it
              **{name: {"minimum": whole_vocab, "maximum": max_logprobs}
                 for name in ("logprobs", "top_logprobs", "prompt_logprobs")}}
    props = model_schema.get("properties", {})
    if "best_of" in props:  # one sample per choice (sampling.refuse_unsupported)
        props["best_of"] = {"anyOf": [{"const": 1}, {"type": "null"}], "title": "Best Of"}
    if "max_completion_tokens" in props:  # chat: it overrides max_tokens, then unchecked
        del ranges["max_tokens"]
    elif "echo" in props:  # completions: 0 with echo scores the prompt (GENERATE_NOTHING)
        ranges["max_tokens"] = {"minimum": 0}
    for name, bounds in ranges.items():
        prop = props.get(name, {})
        for member in prop.get("anyOf", [prop]):
            if member.get("type") in ("number", "integer"):
                member.update(bounds)
    for member in [m for name in ("stop", "bad_words")  # stop strings, bad words non-empty
                   for m in props.get(name, {}).get("anyOf", ())]:
        target = member.get("items") if member.get("type") == "array" else member
        if isinstance(target, dict) and target.get("type") == "string":
            target["minLength"] = 1
    for member in props.get("cache_salt", {}).get("anyOf", ()):  # "" is refused, as vLLM does
        if member.get("type") == "string":
            member["minLength"] = 1
    # bad_words: the cap is on bad_words x n, so at n=1 this many
    for name, limit in (("stop", MAX_STOP_STRINGS), ("stop_token_ids", MAX_STOP_TOKEN_IDS),
                        ("bad_words", MAX_BAD_WORDS_PER_REQUEST)):
        for member in props.get(name, {}).get("anyOf", ()):
            if member.get("type") == "array":
                member["maxItems"] = limit
    for member in props.get("logit_bias", {}).get("anyOf", ()):
        if member.get("type") == "object":  # token id -> bias, OpenAI's range
            member["propertyNames"] = {"pattern": "^[0-9]+$"}
            member["additionalProperties"] = {"type": "number", "minimum": -100, "maximum": 100}
    # -1 (as many as max_model_len leaves room for) or a count >= 1; pydantic's ge=-1 shows
    # up as a bare "ge", which no JSON schema reads.
    for member in props.get("truncate_prompt_tokens", {}).get("anyOf", ()):
        if member.get("type") == "integer":
            member.pop("ge", None)
            member["minimum"], member["not"] = -1, {"const": 0}


def off_only(model_schema: dict, reasoning_parser: bool) -> None:
    """Fields that ask for what Kiln does not do (sampling.OFF_ONLY) take only their off value
    or null; include_reasoning=false needs a reasoning parser."""
    from kiln.entrypoints.openai.sampling import OFF_ONLY

    props = model_schema.get("properties", {})
    offs = {name: off for name, (off, _) in OFF_ONLY.items()}
    if not reasoning_parser:
        offs["include_reasoning"] = True
    empties = {"string": {"const": ""}, "object": {"type": "object", "maxProperties": 0},
               "array": {"type": "array", "maxItems": 0}}
    for name, off in offs.items():
        if name in props:
            types = {m.get("type") for m in props[name].get("anyOf", [props[name]])}
            if None in types:  # any JSON value: each empty one is off
                types = set(empties)
            # an empty value is off too (sampling.refuse_unsupported): truncation_side "",
            # modalities []
            allowed = [{"type": "null"}] + [empties[t] for t in sorted(types & set(empties))]
            if off is not None:
                allowed.insert(0, {"const": off})
            keep = {k: props[name][k] for k in ("title", "default") if k in props[name]}
            props[name] = {"anyOf": allowed, **keep}


def structured_outputs_object() -> dict:
    """What `structured_outputs` takes (StructuredOutputsParams' fields; any other is refused):
    exactly one constraint (a case per kind, the others absent or off), its options."""
    from kiln.structured_output.params import STRUCTURED_OUTPUT_KINDS

    text = {"type": "string", "minLength": 1}
    kinds = {"json": {"anyOf": [text, {"type": "object"}]}, "regex": text,
             "choice": {"type": "array", "minItems": 1, "items": text}, "grammar": text,
             "json_object": {"const": True},
             "structural_tag": {"anyOf": [text, {"type": "object"}]}}
    off = {"json_object": {"enum": [None, False]}}
    assert set(kinds) == set(STRUCTURED_OUTPUT_KINDS)
    return {"type": "object", "additionalProperties": False, "properties": {
        **{k: {"anyOf": [v, off.get(k, NULL)]} for k, v in kinds.items()},
        "disable_any_whitespace": {"type": "boolean"}, "disable_fallback": {"type": "boolean"}},
        "oneOf": [{"required": [kind], "properties": {kind: kinds[kind], **{
            other: off.get(other, NULL) for other in kinds if other != kind}}}
            for kind in kinds]}


def repetition_detection_object(model_schema: dict) -> None:
    """The `repetition_detection` object's fields as the server takes them: integers (null is
    a 400, as vLLM's) within RepetitionDetectionParams' bounds; min <= max and min_count >= 2
    where a size is set are rules across its fields, unstated."""
    from kiln.repetition_detection import MAX_MIN_COUNT, MAX_PATTERN_SIZE

    props = model_schema.get("properties", {})
    for name, most in (("max_pattern_size", MAX_PATTERN_SIZE),
                       ("min_pattern_size", MAX_PATTERN_SIZE), ("min_count", MAX_MIN_COUNT)):
        if name in props:
            keep = {k: props[name][k] for k in ("title", "default") if k in props[name]}
            props[name] = {"type": "integer", "minimum": 0, "maximum": most, **keep}
