"""POST /v1/chat/completions: messages -> the model's chat template -> one request of n samples.

The template renders through the tokenizer's sandboxed Jinja environment (LLMEngine.chat_prompt,
which tokenizes without extra special tokens, since templates write their own BOS).
"""
import functools
import time

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request

from kiln.engine.async_llm import AsyncLLM
from kiln.engine.request_stream import RequestStream
from kiln.entrypoints.openai.beam_search import beam_search
from kiln.entrypoints.openai.chat_answers import ChatAnswers
from kiln.entrypoints.openai.chat_rendering import (
    check_generation_flags,
    generation_tail,
    render_chat_prompt,
    request_chat_template,
)
from kiln.entrypoints.openai.errors import OpenAIError, request_value
from kiln.entrypoints.openai.protocol import ChatCompletionRequest
from kiln.entrypoints.openai.request_defaults import RequestDefaults
from kiln.entrypoints.openai.request_fields import (
    cached_tokens,
    echo_prefix,
    prompt_logprobs_body,
    response_id,
    token_ids_fields,
    with_cache_salt,
)
from kiln.entrypoints.openai.response_models import ChatCompletionResponse, make_usage
from kiln.entrypoints.openai.sampling import chat_sampling_params
from kiln.entrypoints.openai.serving_engine import (
    ClientDisconnected,
    abort_unfinished,
    check_stream_options,
    merge_streams,
    submit,
    until_disconnect,
)
from kiln.entrypoints.openai.serving_models import ServingModels
from kiln.entrypoints.openai.structured_fields import check_compiles, request_structured_outputs
from kiln.entrypoints.openai.tool_parsers.tool_plan import plan_tools
from kiln.lora.frontend import with_lora
from kiln.lora.serving import refuse_lora_beam_search
from kiln.reasoning import (
    grammar_thinking_first,
    make_splitter,
    prompt_opens_thinking,
    with_reasoning_end,
)
from kiln.reasoning.token_count import (
    ReasoningTokenCounter,
    is_blank,
    think_tag_ids,
    total_reasoning_tokens,
)


class ServingChat(ChatAnswers):
    def __init__(self, llm: AsyncLLM, models: ServingModels,
                 enable_prompt_tokens_details: bool = False, *,
                 tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
                 reasoning_parser: str | None = None, disable_any_whitespace: bool = False,
                 trust_request_chat_template: bool = False,
                 defaults: RequestDefaults | None = None):
        self.llm = llm
        self.defaults = defaults or RequestDefaults()
        self.models = models
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.tool_call_parser = tool_call_parser
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.reasoning_parser = reasoning_parser
        self.disable_any_whitespace = disable_any_whitespace
        self.trust_request_chat_template = trust_request_chat_template

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        created = int(time.time())  # the response's, whole or streamed: the request's start
        model = self.models.resolve(req.model)
        check_stream_options(req)
        # before the server's defaults join chat_template_kwargs: its enable_thinking is the
        # request's own only
        effort_vars = reasoning_effort_variables(req.reasoning_effort, req.chat_template_kwargs)
        # vLLM merges the tools field under the request's chat_template_kwargs (over the
        # server's): a non-null "tools" there is what the template sees
        kwargs_tools = (req.chat_template_kwargs or {}).get("tools")
        self.defaults.apply(req)
        check_generation_flags(req)
        self._check_reasoning_fields(req)
        if req.tools:  # off the event loop: 20,000 tools held every stream 1.4 s there
            plan = await self.llm.run_in_engine(plan_tools, req, self.tool_call_parser,
                                                self.enable_auto_tool_choice)
        else:
            plan = plan_tools(req, self.tool_call_parser, self.enable_auto_tool_choice)
        params = chat_sampling_params(req, self.llm.kiln_config.model_config.generation_defaults)
        if plan.parser is not None and plan.parser.keeps_special_tokens:
            params.skip_special_tokens = False  # the call marker is one (vLLM's too)
        constraint, field = request_structured_outputs(req, self.disable_any_whitespace)
        if plan.constraint is not None:
            if constraint is not None:
                raise OpenAIError(f"tool_choice {request_value(req.tool_choice)} fixes the "
                                  f"answer's shape; drop {field}", param=field,
                                  code="invalid_value")
            constraint, field = plan.constraint, "tools"
        if constraint is not None:
            await check_compiles(constraint, field)
        render_args = dict(messages=req.messages, add_generation_prompt=req.add_generation_prompt,
                           continue_final_message=req.continue_final_message,
                           template_kwargs={**(req.chat_template_kwargs or {}), **effort_vars} or None,
                           add_special_tokens=req.add_special_tokens,
                           tools=plan.template_tools if kwargs_tools is None else kwargs_tools,
                           documents=req.documents,
                           chat_template=request_chat_template(
                               req, self.trust_request_chat_template))
        prompt = await render_chat_prompt(self.llm, **render_args)
        prompt = with_lora(with_cache_salt(prompt, req.cache_salt),
                           self.models.lora_request(model))
        prompt_text = prompt.get("prompt")  # what the reasoning parser reads think tags from
        if self.reasoning_parser is not None and prompt_opens_thinking(prompt_text) is not None:
            prompt_text = await generation_tail(self.llm, render_args, prompt_text)
        if constraint is not None:
            constraint = with_reasoning_end(self.reasoning_parser, constraint, prompt_text)
            params.structured_outputs = constraint
        thinking_first = grammar_thinking_first(constraint)
        request_id = response_id("chatcmpl", req.request_id, raw)
        max_tokens_param = ("max_completion_tokens" if req.max_completion_tokens is not None
                            else "max_tokens")
        renamed = {"max_tokens": max_tokens_param, "logprobs": "top_logprobs"}
        if req.use_beam_search:
            refuse_lora_beam_search(self.models.lora_request(model))
            if constraint is not None:  # a tool_choice's grammar: the search follows none
                raise OpenAIError(f"tool_choice={request_value(req.tool_choice)} is refused "
                                  "with use_beam_search=true: beam search follows no grammar; "
                                  'give tool_choice "auto" or "none", or drop use_beam_search',
                                  param="tool_choice", code="unsupported_parameter")
            try:
                (final,) = await until_disconnect(raw, beam_search(
                    self.llm, request_id, [prompt], params, req.length_penalty, "messages",
                    renamed, priority=req.priority))
            except ClientDisconnected:
                return Response(status_code=499)
        else:
            final = await self._generate(req, raw, model, request_id, created, prompt, params,
                                         renamed, plan, prompt_text, thinking_first, field)
            if isinstance(final, Response):
                return final
        echoed = echo_prefix(req, req.messages)
        choices = [self._choice(req, plan, prompt_text, o, echoed, thinking_first)
                   for o in final.outputs]
        counters = [self._counter(prompt_text, thinking_first, o.token_ids)
                    for o in final.outputs]
        usage = make_usage(len(final.prompt_token_ids), sum(len(o.token_ids)
                                                            for o in final.outputs),
                           cached_tokens([final], self.enable_prompt_tokens_details),
                           total_reasoning_tokens(counters))
        as_ids = bool(req.return_tokens_as_token_ids)
        body = ChatCompletionResponse(
            id=request_id, created=created, model=model, choices=choices, usage=usage,
            prompt_logprobs=prompt_logprobs_body(final.prompt_logprobs, as_ids)
            if req.prompt_logprobs is not None else None,
            **token_ids_fields(req, final.prompt_token_ids, None))
        return JSONResponse(body.model_dump())

    async def _generate(self, req, raw, model, request_id, created, prompt, params, renamed,
                        plan, prompt_text, thinking_first, field):
        """The sampled answer: its final output, or the streaming (or 499) response."""
        streams = await submit(self.llm, request_id, [prompt], params, "messages", renamed,
                               priority=req.priority)
        if req.stream:
            return StreamingResponse(self._stream(req, model, request_id, created, streams,
                                                  plan, prompt_text, thinking_first, field),
                                     media_type="text/event-stream")
        try:
            return await until_disconnect(raw, self._collect(streams[0], field))
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            abort_unfinished(self.llm, streams)

    def _check_reasoning_fields(self, req: ChatCompletionRequest) -> None:
        if not req.include_reasoning and self.reasoning_parser is None:
            raise OpenAIError("include_reasoning=false needs the server started with "
                              "--reasoning-parser (without one, no reasoning is split off)",
                              param="include_reasoning", code="invalid_value")

    def _splitter(self, req, prompt_text: str | None, thinking_first: bool | None):
        """The reasoning splitter for one answer; None without --reasoning-parser."""
        if self.reasoning_parser is None:
            return None
        splitter = make_splitter(self.reasoning_parser, prompt_text, thinking_first)
        splitter.keep_reasoning = req.include_reasoning
        return splitter

    @functools.cached_property
    def _think_tag_ids(self) -> tuple[int, int] | None:
        return think_tag_ids(self.llm.tokenizer)

    def _counter(self, prompt_text: str | None, thinking_first: bool | None, token_ids=()):
        """One answer's reasoning token counter (usage's reasoning_tokens, as vLLM reports with
        a reasoning parser), fed `token_ids`; None without --reasoning-parser or single-token
        think tags."""
        if self.reasoning_parser is None or self._think_tag_ids is None:
            return None
        start = make_splitter(self.reasoning_parser, prompt_text, thinking_first).in_reasoning
        counter = ReasoningTokenCounter(self._think_tag_ids, start,
                                        functools.partial(is_blank, self.llm.tokenizer))
        counter.feed(token_ids)
        return counter

    async def _collect(self, stream: RequestStream, field: str | None):
        final = None
        async for _, out in merge_streams([stream], field):
            final = out
        return final


def reasoning_effort_variables(effort: str | None, given: dict | None) -> dict:
    """The template variables chat's reasoning_effort sets, over `given` (the request's
    chat_template_kwargs) and the server's defaults, as vLLM's build_chat_params: the effort,
    and enable_thinking (off for "none") where `given` leaves it unset, for templates that
    think only when asked (Gemma 4's)."""
    if effort is None:
        return {}
    out = {"reasoning_effort": effort}
    if "enable_thinking" not in (given or {}):
        out["enable_thinking"] = effort != "none"
    return out
