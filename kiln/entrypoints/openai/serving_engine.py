"""What the completion and chat handlers share: submitting prompts, merging their streams,
server-sent events, and aborting when the client goes away.
"""
import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable

from pydantic import BaseModel
from starlette.requests import Request

from kiln.engine.async_llm import AsyncLLM, EngineDeadError, EngineShutdownError
from kiln.engine.request_stream import RequestStream
from kiln.entrypoints.openai.errors import OpenAIError, in_api_terms
from kiln.entrypoints.openai.structured_fields import constraint_failure
from kiln.outputs import RequestOutput
from kiln.sampling_params import SamplingParams

SSE_DONE = "data: [DONE]\n\n"
# Request fields the engine checks against the tokenizer, vocabulary or prompt (same names).
# Request fields an engine refusal may name, under the same name in the API.
_SAME_NAME_FIELDS = {name: name for name in ("logit_bias", "allowed_token_ids", "bad_words",
                                             "truncate_prompt_tokens", "cache_salt",
                                             "request_id", "max_tokens", "min_tokens",
                                             "logprobs",
                                             "prompt_logprobs", "stop_token_ids")}


def sse(payload: BaseModel | dict) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


def check_stream_options(req) -> None:
    """stream_options without stream=true is refused (400), as OpenAI and vLLM refuse it; it
    would otherwise be ignored silently."""
    if req.stream_options is not None and not req.stream:
        raise OpenAIError("stream_options is only allowed with stream=true",
                          param="stream_options", code="invalid_value")


def continuous_usage(req) -> bool:
    """Whether every streamed chunk carries the usage so far (vLLM's continuous_usage_stats,
    taken with include_usage)."""
    options = req.stream_options
    return options is not None and options.include_usage and options.continuous_usage_stats


def add_request_error(e: ValueError, prompt_param: str,
                      renamed: dict[str, str] | None = None) -> OpenAIError:
    """A ValueError from LLMEngine.add_request as a 400 naming the request field; `renamed`:
    engine names the request calls otherwise (chat: max_tokens -> max_completion_tokens,
    logprobs -> top_logprobs)."""
    message, param = in_api_terms(str(e), {**_SAME_NAME_FIELDS, "prompt": prompt_param,
                                           **(renamed or {})}, renamed)
    param = param or prompt_param
    code = "context_length_exceeded" if "max_model_len" in message else "invalid_value"
    return OpenAIError(message, param=param, code=code)


def check_num_sequences(num_prompts: int, n: int, limit: int | None, prompt_param: str) -> None:
    """One call's prompts x n within the server's cap, else a 400 naming the field and flag:
    tokenizing and queuing them all first would hold the front end and the KV cache."""
    total = num_prompts * n
    if limit is None or total <= limit:
        return
    raise OpenAIError(f"the request asks for {num_prompts} prompt(s) x n={n} = {total} "
                      f"sequences, more than this server's {limit} "
                      "(--max-sequences-per-request); send fewer prompts or a smaller n",
                      param="n" if n > 1 else prompt_param, code="too_many_sequences")


async def submit(llm: AsyncLLM, base_id: str, prompts: list,
                 params: SamplingParams | list[SamplingParams], prompt_param: str,
                 renamed: dict[str, str] | None = None, *,
                 priority: int = 0) -> list[RequestStream]:
    """Add every prompt as its own request (with its own params, where `params` is a list),
    each with the request's `priority`; if one is refused, none stays queued. As OpenAI
    and vLLM do, a max_tokens that does not fit beside the prompt is refused (400).

    `base_id` names the response; the engine's ids add a random suffix (as vLLM's do): a
    client's id (request_id, X-Request-Id, which proxies keep across retries) may come again
    while the engine still holds outputs of its aborted namesake, which went to the new one."""
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    check_num_sequences(len(prompts), per_prompt[0].n, llm.max_sequences_per_request,
                        prompt_param)
    base_id = f"{base_id}-{secrets.token_hex(4)}"
    arrival = time.monotonic()
    streams: list[RequestStream] = []
    try:
        # Every prompt validated before any is queued: a refused call never runs a step.
        processed = [await llm.process_inputs(prompt, p, max_tokens_must_fit=True)
                     for prompt, p in zip(prompts, per_prompt)]
        for i, (prompt, p, item) in enumerate(zip(prompts, per_prompt, processed)):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            streams.append(await llm.add_request(rid, prompt, p, arrival,
                                                 max_tokens_must_fit=True, processed=item,
                                                 priority=priority))
    except ValueError as e:  # the whole call is refused (400): its requests never ran
        await llm.abort([s.request_id for s in streams], record=False)
        raise add_request_error(e, prompt_param, renamed) from None
    except EngineDeadError as e:
        await llm.abort([s.request_id for s in streams])
        raise engine_unavailable(e) from None
    except BaseException:
        llm.abort_nowait([s.request_id for s in streams])
        raise
    return streams


class ServerShuttingDown(OpenAIError):
    """The 503 of a request the engine refused because the server is shutting down (code
    server_shutting_down, the code the shutdown gate answers with too)."""

    def __init__(self, message: str):
        super().__init__(message, status=503, code="server_shutting_down")


def engine_unavailable(e: EngineDeadError) -> OpenAIError:
    """A 503: the engine crashed (engine_dead), or is shutting down on purpose."""
    if isinstance(e, EngineShutdownError):
        return ServerShuttingDown(str(e))
    return OpenAIError(str(e), status=503, code="engine_dead")


def abort_unfinished(llm: AsyncLLM, streams: list[RequestStream]) -> None:
    ids = [s.request_id for s in streams if not s.finished]
    if ids:
        llm.abort_nowait(ids)


def check_not_failed(out: RequestOutput, constraint_field: str | None = None) -> None:
    """A sample the engine ended for a reason of its own (its grammar allowed no token, the KV
    cache can never hold it) fails the whole call with that reason: a 400, or an error event
    once a stream has begun. A grammar's failure names `constraint_field`, the request field
    its constraint came from (the core only knows it as structured_outputs.X)."""
    for o in out.outputs:
        if o.error is None:
            continue
        if constraint_field is not None and o.error.startswith("structured_outputs."):
            raise constraint_failure(o.error, constraint_field)
        raise OpenAIError(o.error, code="request_failed")


async def merge_streams(streams: list[RequestStream], constraint_field: str | None = None
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every stream as they come; the caller aborts leftovers.
    `constraint_field`: the request field of their structured-output constraint, if any."""
    if len(streams) == 1:
        async for out in streams[0]:
            check_not_failed(out, constraint_field)
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer below
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                check_not_failed(item, constraint_field)
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable):
    """Run `work`; if the client disconnects first, cancel it (its cleanup aborts requests).
    An engine that dies meanwhile is a 503, as at submission."""
    work_task = asyncio.ensure_future(work)
    watch = asyncio.create_task(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if work_task not in done:
        work_task.cancel()
        try:
            await work_task
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the client is gone anyway
            pass
        raise ClientDisconnected()
    try:
        return work_task.result()
    except EngineDeadError as e:
        raise engine_unavailable(e) from None


class ClientDisconnected(Exception):
    """The client hung up before a non-streaming response was ready."""


def error_body_of(e: Exception) -> dict:
    """What went wrong, as the error body a stream's in-band error carries."""
    if isinstance(e, OpenAIError):
        return e.body()
    if isinstance(e, EngineDeadError):  # the code a collected request's 503 has for it
        return engine_unavailable(e).body()
    return OpenAIError(str(e), status=500, code="engine_error").body()


def engine_error_event(e: Exception) -> str:
    return sse(error_body_of(e))
