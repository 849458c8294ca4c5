"""Maps an OpenAI request's fields onto `SamplingParams`, naming the API field on any error.

Pure functions: the range checks live in SamplingParams; this file only translates names.
"""
from kiln.entrypoints.openai.errors import OpenAIError, in_api_terms
from kiln.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                              SamplingFields)
from kiln.sampling_params import RequestOutputKind, SamplingParams

# SamplingParams field -> the request field that set it (identity unless listed).
_SHARED_FIELDS = ["n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids",
                  "ignore_eos", "max_tokens", "min_tokens", "logprobs"]


def _common_kwargs(req: SamplingFields) -> dict:
    if req.logit_bias:
        raise OpenAIError("logit_bias is not supported by this server; omit it",
                          param="logit_bias", code="unsupported_parameter")
    kw = dict(n=req.n, seed=req.seed, presence_penalty=req.presence_penalty,
              frequency_penalty=req.frequency_penalty, stop=req.stop,
              stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
              min_tokens=req.min_tokens, skip_special_tokens=req.skip_special_tokens,
              include_stop_str_in_output=req.include_stop_str_in_output)
    # None means "the default" for these; SamplingParams has the defaults.
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    return kw


def _build(kw: dict, field_names: dict[str, str], stream: bool) -> SamplingParams:
    kw["output_kind"] = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError) as e:
        message, param = in_api_terms(str(e), field_names)
        raise OpenAIError(message, param=param, code="invalid_value") from None


def completion_sampling_params(req: CompletionRequest) -> SamplingParams:
    if req.suffix:
        raise OpenAIError("suffix is not supported by this server; omit it", param="suffix",
                          code="unsupported_parameter")
    if req.best_of is not None and req.best_of != req.n:
        raise OpenAIError(f"best_of must equal n ({req.n}) on this server, got {req.best_of}",
                          param="best_of", code="unsupported_parameter")
    kw = _common_kwargs(req)
    kw.update(max_tokens=req.max_tokens, logprobs=req.logprobs)
    if req.echo and req.logprobs is not None:  # the echoed prompt's tokens get logprobs too
        kw["prompt_logprobs"] = req.logprobs
    names = {name: name for name in _SHARED_FIELDS}
    return _build(kw, names, req.stream)


def chat_sampling_params(req: ChatCompletionRequest) -> SamplingParams:
    if req.top_logprobs is not None and not req.logprobs:
        raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs",
                          code="invalid_value")
    kw = _common_kwargs(req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    kw.update(max_tokens=max_tokens, logprobs=logprobs)
    names = {name: name for name in _SHARED_FIELDS}
    names["max_tokens"] = ("max_completion_tokens" if req.max_completion_tokens is not None
                           else "max_tokens")
    names["logprobs"] = "top_logprobs"
    return _build(kw, names, req.stream)
