"""Maps an OpenAI request's fields onto `SamplingParams`, naming the API field on any error.

Pure functions: the range checks live in SamplingParams; this file translates names, fills the
fields a request leaves unset from the model's generation config, and refuses (400, naming the
field) every vLLM field whose requested behaviour Kiln does not have.
"""
from kiln.config.generation_defaults import default_max_tokens
from kiln.entrypoints.openai.beam_search import check_beam_fields
from kiln.entrypoints.openai.errors import OpenAIError, in_api_terms, request_value
from kiln.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from kiln.repetition_detection import RepetitionDetectionParams, check_fields
from kiln.sampling_params import RequestOutputKind, SamplingParams

# SamplingParams field -> the request field that set it (identity unless listed).
_SHARED_FIELDS = ["n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids",
                  "ignore_eos", "max_tokens", "min_tokens", "logprobs", "logit_bias",
                  "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "prompt_logprobs"]
# Fields whose default is "off": any other value asks for what Kiln does not do.
# field -> (its off value, why it is refused)
OFF_ONLY = {
    "logits_processors": (None, "custom logits processors are not supported"),
    "kv_transfer_params": (None, "disaggregated serving (KV transfer) is not supported"),
    "vllm_xargs": (None, "it carries arguments for custom logits processors and plugins "
                         "(vLLM's SamplingParams.extra_args), and this server loads none"),
    "prompt_embeds": (None, "prompts are text or token ids (no embeddings)"),
    "suffix": (None, "suffix (insertion) is not supported"),
    "mm_processor_kwargs": (None, "the model is text-only"),
    "guided_whitespace_pattern": (None, "whitespace follows JSON's grammar (or none with "
                                        "structured_outputs.disable_any_whitespace)"),
    "logprob_token_ids": (None, "logprobs are of the top tokens (logprobs=N), not given ids"),
    "thinking_token_budget": (None, "no reasoning budget is enforced"),
    "truncation_side": ("left", "truncate_prompt_tokens keeps the prompt's last tokens"),
    "functions": (None, "the legacy functions API is not supported; give tools"),
    "function_call": (None, "the legacy functions API is not supported; give tool_choice"),
    "audio": (None, "the model writes text only"),
    "modalities": (["text"], "the model writes text only"),
}


def refuse_unsupported(req: SamplingFields) -> None:
    """A 400 naming the first field that asks for something Kiln does not do."""
    check_beam_fields(req)
    for name, (off, why) in OFF_ONLY.items():
        if name in type(req).model_fields and getattr(req, name) not in (None, off, "", {}, []):
            raise OpenAIError(f"{name}={request_value(getattr(req, name))} is refused: {why}; "
                              "omit it", param=name, code="unsupported_parameter")
    # 1 (or unset) is one sample per choice; more would be ranked by logprob, which vLLM V1
    # does not do either ("does not yet support best_of"). A field of its own: the schema
    # says 1 or null (not an equality with n, which a schema cannot state cheaply).
    if req.best_of not in (None, 1):
        raise OpenAIError(f"best_of={req.best_of!r} is refused: extra samples ranked by "
                          "logprob are not supported; omit it (or give 1)", param="best_of",
                          code="unsupported_parameter")
    n = getattr(req, "n", None) or 1
    if req.best_of is not None and req.best_of < n:  # OpenAI's and vLLM's rule
        raise OpenAIError(f"best_of must be >= n, got best_of={req.best_of} and n={n}",
                          param="best_of", code="invalid_value")
    # vLLM's rule: stream chunks have no prompt_logprobs field; 0 (the prompt tokens' own
    # logprobs, shown by no chunk) is taken, as vLLM takes it
    if req.prompt_logprobs not in (None, 0) and req.stream:
        raise OpenAIError(f"prompt_logprobs={req.prompt_logprobs} is not available with "
                          "stream=true (as in vLLM): stream chunks carry no prompt_logprobs; "
                          "give 0 or omit it, or set stream=false",
                          param="prompt_logprobs", code="invalid_value")


def _logit_bias(req: SamplingFields) -> dict[int, float] | None:
    if not req.logit_bias:
        return None
    # Token ids in ASCII digits, as the schema says (int() would also take " 7" or "٧").
    bad = next((k for k in req.logit_bias if not (k.isascii() and k.isdigit())), None)
    if bad is not None:
        raise OpenAIError(f"logit_bias keys must be token ids, got {bad!r}", param="logit_bias",
                          code="invalid_value")
    return {int(k): v for k, v in req.logit_bias.items()}


# RepetitionDetectionParams' fields -> the requests' names for them (vLLM's)
_REPETITION_FIELDS = {"max_pattern_size": "max_repetition_pattern_size",
                      "min_pattern_size": "min_repetition_pattern_size",
                      "min_count": "repetition_min_count"}


def _repetition_detection(req: SamplingFields) -> RepetitionDetectionParams | None:
    """Current vLLM's `repetition_detection` object or its earlier flat fields, checked as
    RepetitionDetectionParams is, naming the field as the request gave it."""
    given = {field: getattr(req, name) for field, name in _REPETITION_FIELDS.items()}
    names = _REPETITION_FIELDS
    if req.repetition_detection is not None:
        if any(given.values()):  # two settings of one thing: neither can be picked for them
            flat = next(name for field, name in names.items() if given[field])
            raise OpenAIError(f"repetition_detection and {flat} are the same setting (vLLM's "
                              "object and its earlier flat fields): give one of them",
                              param="repetition_detection", code="invalid_value")
        given, names = req.repetition_detection.model_dump(), None
        if not given["max_pattern_size"] and not given["min_pattern_size"]:
            return None  # off, whatever min_count says: vLLM's object takes that
    if not any(given.values()):
        return None
    try:
        check_fields(given, names)
    except ValueError as e:
        raise OpenAIError(str(e), param=str(e).split(" ", 1)[0], code="invalid_value") from None
    return RepetitionDetectionParams(**given)


def _common_kwargs(req: SamplingFields, defaults: dict) -> dict:
    refuse_unsupported(req)
    kw = dict(n=req.n, seed=req.seed, presence_penalty=req.presence_penalty,
              frequency_penalty=req.frequency_penalty, stop=req.stop,
              stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
              min_tokens=req.min_tokens, skip_special_tokens=req.skip_special_tokens,
              spaces_between_special_tokens=req.spaces_between_special_tokens,
              include_stop_str_in_output=req.include_stop_str_in_output,
              logit_bias=_logit_bias(req), allowed_token_ids=req.allowed_token_ids,
              bad_words=req.bad_words or None,
              truncate_prompt_tokens=req.truncate_prompt_tokens,
              repetition_detection=_repetition_detection(req),
              # no stream chunk shows them: the engine is spared computing them
              prompt_logprobs=None if req.stream else req.prompt_logprobs)
    # None means "the default": the model's (--generation-config), else SamplingParams'.
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(req, name)
        if value is None:
            value = defaults.get(name)
        if value is not None:
            kw[name] = value
    return kw


def _build(kw: dict, field_names: dict[str, str], stream: bool) -> SamplingParams:
    kw["output_kind"] = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError) as e:
        renamed = {k: v for k, v in field_names.items() if k != v}
        message, param = in_api_terms(str(e), field_names, renamed)
        raise OpenAIError(message, param=param, code="invalid_value") from None


def completion_sampling_params(req: CompletionRequest,
                               defaults: dict | None = None) -> SamplingParams:
    """`defaults`: the model's sampling defaults (ModelConfig.generation_defaults)."""
    defaults = defaults or {}
    kw = _common_kwargs(req, defaults)
    kw.update(max_tokens=default_max_tokens(req.max_tokens, defaults), logprobs=req.logprobs)
    if req.max_tokens == 0:
        _check_echo_only(req)
        # The engine samples one token after the prompt, which the answer leaves out (vLLM's
        # way): the prompt's logprobs come from the step that ends in that sample.
        kw["max_tokens"] = 1
    if req.echo and req.logprobs is not None:
        # the echoed prompt's tokens get logprobs too (the request's top count if it gave one)
        kw["prompt_logprobs"] = req.logprobs if req.prompt_logprobs is None \
            else req.prompt_logprobs
    names = {name: name for name in _SHARED_FIELDS}
    return _build(kw, names, req.stream)


def echo_only(req: CompletionRequest) -> bool:
    """echo with max_tokens 0 (OpenAI's legacy API, vLLM's): the prompt comes back, with its
    logprobs when asked, and nothing generated: how evaluation harnesses score a text."""
    return req.echo and req.max_tokens == 0


def _check_echo_only(req: CompletionRequest) -> None:
    if not req.echo:
        raise OpenAIError("max_tokens=0 generates nothing: give echo=true to get the prompt "
                          "back scored (its logprobs with logprobs=N), or ask for 1 token or "
                          "more", param="max_tokens", code="invalid_value")
    if req.min_tokens:
        raise OpenAIError(f"min_tokens={req.min_tokens} is more than max_tokens=0; omit it",
                          param="min_tokens", code="invalid_value")


def chat_sampling_params(req: ChatCompletionRequest,
                         defaults: dict | None = None) -> SamplingParams:
    defaults = defaults or {}
    if req.top_logprobs is not None and not req.logprobs:
        raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs",
                          code="invalid_value")
    kw = _common_kwargs(req, defaults)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    kw.update(max_tokens=default_max_tokens(max_tokens, defaults), logprobs=logprobs)
    names = {name: name for name in _SHARED_FIELDS}
    names["max_tokens"] = ("max_completion_tokens" if req.max_completion_tokens is not None
                           else "max_tokens")
    names["logprobs"] = "top_logprobs"
    return _build(kw, names, req.stream)
