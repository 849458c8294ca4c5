"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it for a text model), on the chat
path: the input rendered as a chat (responses_input.py), sampled and constrained as chat's
fields say, the answer shaped as a response object or its event stream (responses_objects.py);
with background, run detached (responses_background.py).
"""
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kiln.entrypoints.openai.chat_rendering import generation_tail, render_chat_prompt
from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.request_fields import with_cache_salt
from kiln.entrypoints.openai.responses_background import BackgroundResponses
from kiln.entrypoints.openai.responses_input import (
    chat_request,
    in_responses_terms,
    input_messages,
    refuse_unsupported,
)
from kiln.entrypoints.openai.responses_objects import (
    EventWriter,
    IncompleteDetails,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponsesResponse,
    make_response_usage,
)
from kiln.entrypoints.openai.responses_protocol import ResponsesRequest
from kiln.entrypoints.openai.responses_store import ResponseStore
from kiln.entrypoints.openai.responses_stream import StreamItems
from kiln.entrypoints.openai.responses_tools import call_items
from kiln.entrypoints.openai.sampling import chat_sampling_params
from kiln.entrypoints.openai.serving_chat import ServingChat, reasoning_effort_variables
from kiln.entrypoints.openai.serving_engine import (
    ClientDisconnected,
    abort_unfinished,
    error_body_of,
    merge_streams,
    submit,
    until_disconnect,
)
from kiln.entrypoints.openai.structured_fields import check_compiles, request_structured_outputs
from kiln.entrypoints.openai.tool_parsers.base import ToolCallStream
from kiln.entrypoints.openai.tool_parsers.tool_plan import plan_tools
from kiln.lora.frontend import with_lora
from kiln.reasoning import grammar_thinking_first, prompt_opens_thinking, with_reasoning_end

# The engine's finish reason -> the response's status.
_STATUS = {"length": "incomplete", "abort": "cancelled"}


class ServingResponses:
    """Shares the chat handler's engine, models, flags and reasoning splitting."""

    def __init__(self, chat: ServingChat, store: ResponseStore | None = None):
        self.chat = chat
        self.llm = chat.llm
        self.store = store or ResponseStore()
        self.background = BackgroundResponses(self.llm, self.store)

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        created = int(time.time())
        model = self.chat.models.resolve(req.model)
        refuse_unsupported(req)
        previous = self.store.check(req)
        history = previous.history() if previous is not None else ()
        # Off the event loop, as chat's messages: 20,000 items held every stream 0.3 s there
        messages, sources = await self.llm.run_in_engine(input_messages, req, history)
        with in_responses_terms(sources):
            creq = chat_request(req, messages)
            if creq.tools:  # off the event loop, as chat's
                plan = await self.llm.run_in_engine(plan_tools, creq, self.chat.tool_call_parser,
                                                    self.chat.enable_auto_tool_choice,
                                                    req.max_tool_calls)
            else:
                plan = plan_tools(creq, None, False)
            params = chat_sampling_params(
                creq, self.llm.kiln_config.model_config.generation_defaults)
            if plan.parser is not None and plan.parser.keeps_special_tokens:
                params.skip_special_tokens = False  # the call marker is one, as on chat
            constraint, field = request_structured_outputs(creq,
                                                           self.chat.disable_any_whitespace)
            # what a grammar's failure names, in a stream or a collected answer too
            field = "text.format" if field == "response_format" else field
            if plan.constraint is not None:  # tool_choice required or a named function
                if constraint is not None:
                    raise OpenAIError(f"tool_choice {req.tool_choice!r} fixes the answer's "
                                      "shape; drop text.format", param="text.format",
                                      code="invalid_value")
                constraint, field = plan.constraint, "tools"
            if constraint is not None:
                await check_compiles(constraint, field)
            render_args = dict(messages=messages, add_generation_prompt=True,
                               continue_final_message=False,
                               template_kwargs={
                                   **(self.chat.defaults.template_kwargs(None) or {}),
                                   **reasoning_effort_variables(
                                       (req.reasoning or {}).get("effort"), None)} or None,
                               add_special_tokens=False, tools=plan.template_tools,
                               documents=None, chat_template=None)
            prompt = await render_chat_prompt(self.llm, **render_args)
        prompt = with_lora(with_cache_salt(prompt, req.cache_salt),
                           self.chat.models.lora_request(model))
        prompt_text = prompt.get("prompt")
        if self.chat.reasoning_parser is not None and \
                prompt_opens_thinking(prompt_text) is not None:
            prompt_text = await generation_tail(self.llm, render_args, prompt_text)
        if constraint is not None:
            constraint = with_reasoning_end(self.chat.reasoning_parser, constraint, prompt_text)
            params.structured_outputs = constraint
        thinking_first = grammar_thinking_first(constraint)
        header = raw.headers.get("x-request-id")
        rid = f"resp_{header or req.request_id or uuid.uuid4().hex}"
        self.background.check(req, rid)
        streams = await submit(self.llm, rid, [prompt], params, "input",
                               {"max_tokens": "max_output_tokens"}, priority=req.priority)
        try:  # again: a namesake (or the bound's last place) may have started during submit
            self.background.check(req, rid)
        except OpenAIError:  # refused: its requests never ran, as submit's own refusals
            await self.llm.abort([s.request_id for s in streams], record=False)
            raise
        shape = _Shape(req, model, rid, created, params, creq, prompt_text, thinking_first)
        shape.plan, shape.previous, shape.store = plan, previous, self.store.keeps(req)
        if req.background:
            queued = shape.response("queued", [], None)
            work = self._stream(shape, streams, field) if req.stream else \
                self._answer(shape, streams, field)
            return self.background.start(queued, previous, req.input, streams, work)
        if req.stream:
            return StreamingResponse(self._stream(shape, streams, field),
                                     media_type="text/event-stream")
        try:
            response = await until_disconnect(raw, self._answer(shape, streams, field))
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            abort_unfinished(self.llm, streams)
        return JSONResponse(response.model_dump())

    async def _answer(self, shape: "_Shape", streams, field: str | None) -> ResponsesResponse:
        """The whole response (kept where the request asks)."""
        final = await self.chat._collect(streams[0], field)
        plan, creq, prompt_text = shape.plan, shape.creq, shape.prompt_text
        o = final.outputs[0]
        reasoning, content = None, o.text
        splitter = self.chat._splitter(creq, prompt_text, shape.thinking_first)
        if splitter is not None:
            reasoning, content = splitter.split(o.text)
        calls = []
        if plan.parser is not None and content is not None:
            content, calls = plan.parser.extract(content)
        status = _STATUS.get(o.finish_reason, "completed")
        last = "incomplete" if status != "completed" else status  # the last item's, as streamed
        output = []
        if reasoning:  # cut while thinking (no content after it): incomplete too
            output.append(ReasoningItem(content=[ReasoningText(text=reasoning)],
                                        status="completed" if content or calls else last))
        if content or not calls:
            output.append(OutputMessage(content=[OutputText(text=content or "")],
                                        status=last if not calls else "completed"))
        output += call_items(calls, plan.parser.template_checks_ids if calls else False)
        if calls:
            output[-1].status = last
        counter = self.chat._counter(prompt_text, shape.thinking_first, o.token_ids)
        usage = make_response_usage(len(final.prompt_token_ids), len(o.token_ids),
                                    final.num_cached_tokens,
                                    None if counter is None else counter.count)
        return self._kept(shape, shape.response(status, output, usage))

    async def _stream(self, shape: "_Shape", streams, field: str | None):
        event = EventWriter()
        prompt_tokens = streams[0].num_prompt_tokens
        splitter = self.chat._splitter(shape.creq, shape.prompt_text, shape.thinking_first)
        tools = ToolCallStream(shape.plan.parser) if shape.plan.parser is not None else None
        own_ids = tools is not None and tools.parser.template_checks_ids
        counter = self.chat._counter(shape.prompt_text, shape.thinking_first)
        items = StreamItems(event)
        generated = cached = 0
        finish = None
        try:
            if shape.req.background:  # OpenAI's order: created and queued (both queued)
                queued = shape.response("queued", [], None)
                yield event("response.created", response=queued)
                yield event("response.queued", response=queued)
            else:
                yield event("response.created", response=shape.response("in_progress", [], None))
            yield event("response.in_progress", response=shape.response("in_progress", [], None))
            async for _, out in merge_streams(streams, field):
                cached = max(cached, out.num_cached_tokens)
                for o in out.outputs:
                    generated += len(o.token_ids)
                    if counter is not None:
                        counter.feed(o.token_ids)
                    final = o.finish_reason is not None
                    finish = o.finish_reason if final else finish
                    reasoning, content = ("", o.text) if splitter is None else \
                        splitter.feed(o.text, final)
                    calls = []
                    if tools is not None:
                        content, calls = tools.feed(content, final)
                    for kind, text in (("reasoning", reasoning), ("message", content)):
                        if text:
                            for e in items.text(kind, text):
                                yield e
                    for e in items.tool_calls(calls, own_ids):
                        yield e
            status = _STATUS.get(finish, "completed")
            last = "incomplete" if status != "completed" else status  # the last item's
            for e in items.finish(last):
                yield e
            usage = make_response_usage(prompt_tokens, generated, cached,
                                        None if counter is None else counter.count)
            # response.completed whatever the status (incomplete at the token limit), as vLLM
            # ends its streams: the openai SDK's responses.stream() has no final response
            # (get_final_response raises) after OpenAI's response.incomplete.
            yield event("response.completed",
                        response=self._kept(shape, shape.response(status, items.output, usage)))
        except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band
            # OpenAI's error event: the error body's fields, beside the type
            info = error_body_of(e)["error"]
            yield event("error", code=info["code"], message=info["message"],
                        param=info["param"])
        finally:
            abort_unfinished(self.llm, streams)

    def _kept(self, shape: "_Shape", response: ResponsesResponse) -> ResponsesResponse:
        """`response`, stored where the request asks to keep it."""
        if response.store:
            self.store.put(response.model_dump(), shape.previous, shape.req.input)
        return response


class _Shape:
    """What every response object of one request shares: the request's echoed fields and the
    sampling it ran with."""

    def __init__(self, req: ResponsesRequest, model: str, rid: str, created: int, params,
                 creq, prompt_text: str | None, thinking_first: bool | None):
        self.req, self.model, self.rid, self.created, self.params = \
            req, model, rid, created, params
        self.creq, self.prompt_text, self.thinking_first = creq, prompt_text, thinking_first
        self.plan = self.previous = None  # the tool plan; the stored response continued
        self.store = False  # whether the response is kept

    def response(self, status: str, output: list, usage) -> ResponsesResponse:
        req = self.req
        text = req.text.model_dump(by_alias=True, exclude_none=True) \
            if req.text is not None and req.text.format is not None else None
        return ResponsesResponse(
            id=self.rid, created_at=self.created, status=status, model=self.model,
            output=list(output), usage=usage,
            incomplete_details=IncompleteDetails() if status == "incomplete" else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            max_tool_calls=req.max_tool_calls,
            metadata=req.metadata or {}, user=req.user,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            temperature=self.params.temperature, top_p=self.params.top_p,
            tool_choice=req.tool_choice or "auto", tools=req.tools or [],
            store=self.store, previous_response_id=req.previous_response_id,
            background=req.background is True,
            **({"text": text} if text is not None else {}))
