"""POST /v1/completions: prompts (text or token ids, one or many) -> choices, whole or streamed.

Choice index = prompt index * n + sample index, as OpenAI numbers them.
"""
import dataclasses
import time

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request

from kiln.engine.async_llm import AsyncLLM
from kiln.engine.prompt_length import may_be_truncated
from kiln.engine.request_stream import RequestStream
from kiln.engine.text_encoding import encode_text
from kiln.entrypoints.openai.beam_search import beam_search
from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.logprob_format import completion_logprobs
from kiln.entrypoints.openai.protocol import CompletionRequest
from kiln.entrypoints.openai.request_defaults import RequestDefaults
from kiln.entrypoints.openai.request_fields import (
    cached_tokens,
    prompt_logprobs_body,
    response_id,
    token_ids_fields,
    with_cache_salt,
)
from kiln.entrypoints.openai.response_models import CompletionChoice, CompletionResponse, make_usage
from kiln.entrypoints.openai.sampling import completion_sampling_params, echo_only
from kiln.entrypoints.openai.serving_engine import (
    SSE_DONE,
    ClientDisconnected,
    abort_unfinished,
    check_stream_options,
    continuous_usage,
    engine_error_event,
    merge_streams,
    sse,
    submit,
    until_disconnect,
)
from kiln.entrypoints.openai.serving_models import ServingModels
from kiln.entrypoints.openai.structured_fields import check_compiles, request_structured_outputs
from kiln.lora.frontend import with_lora
from kiln.lora.serving import refuse_lora_beam_search
from kiln.outputs import CompletionOutput, RequestOutput
from kiln.reasoning import with_reasoning_end
from kiln.sampling_params import SamplingParams


def engine_prompts(prompt, param: str = "prompt") -> list:
    """The OpenAI `prompt` field (a pooling request's `input`: `param`) as a list of engine
    prompts (text or token-id dicts)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError(f"{param} is empty: give a string, a list of strings or token ids",
                          param=param, code="invalid_value")
    # Validated (protocol.PromptInput): one kind of item throughout, so the first one says which.
    if isinstance(prompt[0], int):
        return [{"prompt_token_ids": list(prompt)}]
    if isinstance(prompt[0], list):
        return [{"prompt_token_ids": list(p)} for p in prompt]
    return list(prompt)


async def without_special_tokens(llm: AsyncLLM, prompts: list) -> list:
    """add_special_tokens=false: text prompts tokenized without BOS (on the engine thread)."""
    tokenizer = llm.tokenizer
    if tokenizer is None:
        return prompts  # no tokenizer: only token-id prompts pass, as without this field

    def encode(text: str) -> dict:
        return {"prompt": text,
                "prompt_token_ids": encode_text(tokenizer, text, add_special_tokens=False)}

    return [await llm.run_in_engine(encode, p) if isinstance(p, str) else p for p in prompts]


class ServingCompletion:
    def __init__(self, llm: AsyncLLM, models: ServingModels,
                 enable_prompt_tokens_details: bool = False,
                 disable_any_whitespace: bool = False, reasoning_parser: str | None = None,
                 defaults: RequestDefaults | None = None):
        self.llm = llm
        self.defaults = defaults or RequestDefaults()
        self.reasoning_parser = reasoning_parser
        self.models = models
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.disable_any_whitespace = disable_any_whitespace

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        created = int(time.time())  # the response's, whole or streamed: the request's start
        model = self.models.resolve(req.model)
        check_stream_options(req)
        self.defaults.apply(req)
        params = completion_sampling_params(req,
                                            self.llm.kiln_config.model_config.generation_defaults)
        constraint, field = request_structured_outputs(req, self.disable_any_whitespace)
        if constraint is not None:
            await check_compiles(constraint, field)
            params.structured_outputs = constraint
        prompts = engine_prompts(req.prompt)
        if req.echo and self.llm.tokenizer is None:
            raise OpenAIError("echo needs a tokenizer to write the prompt's text; this server "
                              "runs with --skip-tokenizer-init", param="echo",
                              code="unsupported_parameter")
        if not req.add_special_tokens:
            prompts = await without_special_tokens(self.llm, prompts)
        lora = self.models.lora_request(model)
        prompts = [with_lora(with_cache_salt(p, req.cache_salt), lora) for p in prompts]
        request_id = response_id("cmpl", req.request_id, raw)
        if req.use_beam_search:
            refuse_lora_beam_search(lora)
            try:
                finals = await until_disconnect(raw, beam_search(
                    self.llm, request_id, prompts, params, req.length_penalty, "prompt",
                    priority=req.priority))
            except ClientDisconnected:
                return Response(status_code=499)
            return JSONResponse((await self._response(req, model, request_id, created, prompts,
                                                      finals)).model_dump())
        per_prompt = await self._reasoning_params(params, prompts)
        try:  # a long list of prompts takes a while to add: a client that leaves stops it
            streams = await until_disconnect(
                raw, submit(self.llm, request_id, prompts, per_prompt, "prompt",
                                 priority=req.priority))
        except ClientDisconnected:
            return Response(status_code=499)
        if req.stream:
            return StreamingResponse(self._stream(req, model, request_id, created, prompts,
                                                  streams, field),
                                     media_type="text/event-stream")
        try:
            finals = await until_disconnect(raw, self._collect(streams, field))
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            abort_unfinished(self.llm, streams)
        return JSONResponse((await self._response(req, model, request_id, created, prompts,
                                                  finals)).model_dump())

    async def _reasoning_params(self, params: SamplingParams, prompts: list
                                ) -> list[SamplingParams]:
        """Each prompt's params. With --reasoning-parser, a grammar waits for </think> unless
        the prompt closed the thinking, here as in chat: vLLM's reasoner is the engine's and
        reads every constrained request's prompt (its text is not split: vLLM's completions
        have no reasoning_content)."""
        constraint = params.structured_outputs
        if self.reasoning_parser is None or constraint is None:
            return [params] * len(prompts)
        waiting, out = None, []  # the params whose grammar waits, made once
        for prompt in prompts:
            text = prompt if isinstance(prompt, str) else prompt.get("prompt")
            if text is None and self.llm.tokenizer is not None:  # token ids: their text
                text = await self.llm.run_in_engine(self.llm.tokenizer.decode,
                                                    prompt["prompt_token_ids"])
            waits = with_reasoning_end(self.reasoning_parser, constraint, text)
            if waits is not constraint and waiting is None:
                waiting = params.clone()
                waiting.structured_outputs = waits
            out.append(params if waits is constraint else waiting)
        return out

    async def _collect(self, streams: list[RequestStream], field: str | None
                       ) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for i, out in merge_streams(streams, field):
            finals[i] = out
        return finals

    async def _prompt_text(self, req: CompletionRequest, prompt, out: RequestOutput) -> str:
        """The prompt as echo writes it: the text sent, where the engine read all of it; else
        the text of the tokens it read (token ids sent, or a text truncate_prompt_tokens cut,
        whose echo must be the tokens its logprobs and text_offset describe, BOS included)."""
        text = prompt if isinstance(prompt, str) else (
            prompt.get("prompt") if isinstance(prompt, dict) else None)
        if isinstance(text, str) and not (
                may_be_truncated(len(out.prompt_token_ids), req.truncate_prompt_tokens,
                                 self.llm.max_model_len)
                and await self._was_cut(text, req, len(out.prompt_token_ids))):
            return text
        return await self.llm.run_in_engine(self.llm.tokenizer.decode, out.prompt_token_ids)

    async def _was_cut(self, text: str, req: CompletionRequest, num_read: int) -> bool:
        """Whether the engine read fewer tokens than `text` has: one that fit whole may be
        exactly as long as truncation keeps."""
        ids = await self.llm.run_in_engine(encode_text, self.llm.tokenizer, text,
                                           add_special_tokens=req.add_special_tokens)
        return len(ids) > num_read

    def _logprobs(self, req: CompletionRequest, o: CompletionOutput, offset: int,
                  echoed: RequestOutput | None = None):
        """The choice's logprobs; with `echoed` (echo: the prompt goes first in the text), the
        prompt's tokens and logprobs go first too."""
        if req.logprobs is None or o.logprobs is None:
            return None
        token_ids, logprobs = o.token_ids, o.logprobs
        if echoed is not None:
            if echoed.prompt_logprobs is None:
                raise RuntimeError("echo with logprobs: the engine sent no prompt logprobs")
            token_ids = echoed.prompt_token_ids + token_ids
            logprobs = echoed.prompt_logprobs + logprobs
        return completion_logprobs(token_ids, logprobs, self.llm.tokenizer, req.logprobs,
                                   offset, as_token_ids=bool(req.return_tokens_as_token_ids))

    async def _response(self, req, model, request_id, created: int, prompts,
                        finals: list[RequestOutput]) -> CompletionResponse:
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for i, out in enumerate(finals):
            prompt_tokens += len(out.prompt_token_ids)
            prefix = await self._prompt_text(req, prompts[i], out) if req.echo else ""
            for o in out.outputs:
                o = _as_answered(req, o)
                completion_tokens += len(o.token_ids)
                choices.append(CompletionChoice(
                    index=i * req.n + o.index, text=prefix + o.text,
                    logprobs=self._logprobs(req, o, 0, out if req.echo else None),
                    finish_reason=o.finish_reason,
                    stop_reason=o.stop_reason,
                    prompt_logprobs=prompt_logprobs_body(
                        out.prompt_logprobs if req.prompt_logprobs is not None else None,
                        bool(req.return_tokens_as_token_ids)),
                    **token_ids_fields(req, out.prompt_token_ids, o.token_ids)))
        choices.sort(key=lambda c: c.index)
        cached = cached_tokens(finals, self.enable_prompt_tokens_details)
        return CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                  usage=make_usage(prompt_tokens, completion_tokens, cached))

    async def _stream(self, req, model, request_id, created: int, prompts, streams,
                      field: str | None):
        prompt_tokens: dict[int, int] = {}  # prompt index -> its tokens
        completion_tokens: dict[int, int] = {}  # choice index -> its tokens so far
        # choice index -> characters of its tokens so far (text_offset; text held back for a
        # possible stop string is not sent yet, but its tokens' logprobs are)
        offsets: dict[int, int] = {}
        # Prompt i's output carrying its prompt logprobs (they come once, with the first token).
        with_prompt_logprobs: dict[int, RequestOutput] = {}
        cached: dict[int, int] = {}
        sent: set[int] = set()  # choices that had a chunk
        try:
            async for i, out in merge_streams(streams, field):
                if out.prompt_token_ids:
                    prompt_tokens[i] = len(out.prompt_token_ids)
                cached[i] = max(cached.get(i, 0), out.num_cached_tokens)
                if out.prompt_logprobs is not None:
                    with_prompt_logprobs[i] = out
                for o in out.outputs:
                    o = _as_answered(req, o)
                    index = i * req.n + o.index
                    text, echoed = o.text, None
                    if req.echo and index not in offsets:
                        text = await self._prompt_text(req, prompts[i], out) + text
                        echoed = with_prompt_logprobs.get(i, out)
                    completion_tokens[index] = completion_tokens.get(index, 0) + \
                        len(o.token_ids)
                    lp = self._logprobs(req, o, offsets.get(index, 0), echoed)
                    offsets[index] = (lp.text_offset[-1] + len(lp.tokens[-1]) if lp and lp.tokens
                                      else offsets.get(index, 0))
                    if not text and not o.token_ids and o.finish_reason is None:
                        continue
                    first_chunk = index not in sent
                    sent.add(index)
                    choice = CompletionChoice(index=index, text=text, logprobs=lp,
                                              finish_reason=o.finish_reason,
                                              stop_reason=o.stop_reason,
                                              **token_ids_fields(
                                                  req, out.prompt_token_ids if first_chunk
                                                  else None, o.token_ids))
                    # As vLLM's: this choice's own prompt and tokens so far.
                    usage = (make_usage(prompt_tokens.get(i, 0), completion_tokens[index])
                             if continuous_usage(req) else None)
                    yield sse(CompletionResponse(id=request_id, created=created, model=model,
                                                 choices=[choice], usage=usage))
            if req.stream_options is not None and req.stream_options.include_usage:
                usage = make_usage(sum(prompt_tokens.values()), sum(completion_tokens.values()),
                                   sum(cached.values()) if self.enable_prompt_tokens_details
                                   else None)
                yield sse(CompletionResponse(id=request_id, created=created, model=model,
                                             choices=[], usage=usage))
        except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band
            yield engine_error_event(e)
        finally:
            abort_unfinished(self.llm, streams)
        yield SSE_DONE


def _as_answered(req: CompletionRequest, o: CompletionOutput) -> CompletionOutput:
    """A sample as the answer shows it: an echo-only request's (max_tokens 0) without the one
    token the engine sampled after the prompt, ended by its length of 0 once the engine is
    done with it."""
    if not echo_only(req):
        return o
    return dataclasses.replace(o, text="", token_ids=[], cumulative_logprob=None,
                               logprobs=None if o.logprobs is None else [],
                               finish_reason="length" if o.finished() else None,
                               stop_reason=None)
