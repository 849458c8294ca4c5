"""vLLM's request fields beyond sampling, as the completion and chat handlers apply them:
request_id, cache_salt, prompt_logprobs in the response, cached-token usage, chat echo.
"""
from kiln.engine.chat_messages import chat_messages
from kiln.entrypoints.openai.logprob_format import token_id_text
from kiln.entrypoints.openai.response_models import PromptLogprob, PromptLogprobs
from kiln.outputs import Logprob, RequestOutput


def response_id(prefix: str, request_id: str | None, raw=None) -> str:
    """The response's id: the client's X-Request-Id header or else its request_id field if it
    sent one (vLLM's order), else a fresh one. `raw`: the HTTP request."""
    import uuid

    header = raw.headers.get("x-request-id") if raw is not None else None
    return f"{prefix}-{header or request_id or uuid.uuid4().hex}"


def with_cache_salt(prompt: str | dict, cache_salt: str | None) -> str | dict:
    """An engine prompt carrying the request's cache_salt (the engine seeds block hashes)."""
    if cache_salt is None:
        return prompt
    if isinstance(prompt, str):
        return {"prompt": prompt, "cache_salt": cache_salt}
    return {**prompt, "cache_salt": cache_salt}


def prompt_logprobs_body(entries: list[dict[int, Logprob] | None] | None,
                         as_token_ids: bool = False) -> PromptLogprobs | None:
    """Prompt logprobs as vLLM's responses carry them: per prompt token, id -> logprob, rank,
    decoded token (None for the first, which nothing predicts)."""
    if entries is None:
        return None
    return [None if step is None else {
        tid: PromptLogprob(logprob=max(lp.logprob, -9999.0), rank=lp.rank,
                           decoded_token=token_id_text(tid) if as_token_ids
                           else lp.decoded_token)
        for tid, lp in step.items()} for step in entries]


def cached_tokens(outputs: list[RequestOutput | None], enabled: bool) -> int | None:
    """Prompt tokens the prefix cache held, over the prompts of a request; None unless
    --enable-prompt-tokens-details (then usage carries prompt_tokens_details)."""
    if not enabled:
        return None
    return sum(out.num_cached_tokens for out in outputs if out is not None)


def echo_prefix(req, messages: list) -> str:
    """Chat echo (vLLM's): the reply starts with the last message's content when that message
    is the role the reply continues (continue_final_message: the assistant's own)."""
    if not req.echo or not messages:
        return ""
    last = messages[-1]
    role = "assistant" if req.add_generation_prompt and not req.continue_final_message \
        else last.role
    if last.role != role:
        return ""
    # The content as the template got it: every text part (input_text, output_text, refusal
    # too; "text" alone dropped the others from the echo), joined with newlines.
    return chat_messages([last.model_dump(exclude_none=True)])[0]["content"]


def token_ids_fields(req, prompt_token_ids: list[int] | None,
                     token_ids: list[int] | None) -> dict:
    """return_token_ids (vLLM's): the ids beside the text, for clients that do their own
    detokenization (or an engine with skip_tokenizer_init); nothing unless asked."""
    if not req.return_token_ids:
        return {}
    out = {}
    if prompt_token_ids is not None:
        out["prompt_token_ids"] = list(prompt_token_ids)
    if token_ids is not None:
        out["token_ids"] = list(token_ids)
    return out
