"""`ChatAnswers`: ServingChat's engine outputs as chat completion bodies: a whole answer's choices
(reasoning, content and tool calls split apart), and the stream's chunks, each choice's deltas.
"""
from dataclasses import replace

from kiln.entrypoints.openai.logprob_format import chat_logprobs
from kiln.entrypoints.openai.protocol import ChatCompletionRequest
from kiln.entrypoints.openai.request_fields import echo_prefix, token_ids_fields
from kiln.entrypoints.openai.response_models import (
    ChatCompletionChoice,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    make_usage,
)
from kiln.entrypoints.openai.serving_engine import (
    SSE_DONE,
    abort_unfinished,
    continuous_usage,
    engine_error_event,
    merge_streams,
    sse,
)
from kiln.entrypoints.openai.tool_parsers.base import ToolCallStream
from kiln.entrypoints.openai.tool_parsers.tool_plan import ToolPlan
from kiln.outputs import CompletionOutput
from kiln.reasoning.token_count import total_reasoning_tokens


class ChatAnswers:
    """Mixed into `ServingChat` (serving_chat.py), whose settings and reasoning splitter and
    counter these methods use."""

    def _choice(self, req, plan: ToolPlan, prompt_text: str | None, o: CompletionOutput,
                echoed: str = "", thinking_first: bool | None = None) -> ChatCompletionChoice:
        reasoning, content = None, o.text
        splitter = self._splitter(req, prompt_text, thinking_first)
        if splitter is not None:
            reasoning, content = splitter.split(o.text)
        calls = []
        if plan.parser is not None and content is not None:
            content, calls = plan.parser.extract(content)
        if echoed:
            content = echoed + (content or "")
        return ChatCompletionChoice(
            index=o.index, message=ChatResponseMessage(content=content,
                                                       reasoning_content=reasoning,
                                                       tool_calls=calls),
            logprobs=self._logprobs(req, o),
            finish_reason=_finish_reason(o.finish_reason, o.stop_reason, plan, bool(calls)),
            stop_reason=o.stop_reason, **token_ids_fields(req, None, o.token_ids))

    def _logprobs(self, req: ChatCompletionRequest, o: CompletionOutput) -> ChatLogprobs | None:
        if not req.logprobs or o.logprobs is None:
            return None
        return ChatLogprobs(content=chat_logprobs(o.token_ids, o.logprobs, self.llm.tokenizer,
                                                  req.top_logprobs or 0,
                                                  bool(req.return_tokens_as_token_ids)))

    async def _stream(self, req, model, request_id, created: int, streams, plan: ToolPlan,
                      prompt_text: str | None, thinking_first: bool | None,
                      field: str | None):
        def chunk(choices, usage=None, prompt_token_ids=None) -> str:
            return sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model,
                                                    choices=choices, usage=usage,
                                                    prompt_token_ids=prompt_token_ids))

        prompt_tokens = streams[0].num_prompt_tokens  # the role chunk's usage needs it first
        cached = 0
        completion_tokens: dict[int, int] = {}  # choice index -> its tokens so far
        continuous = continuous_usage(req)
        prompt_ids_sent = False  # return_token_ids: the prompt's go in the first content chunk
        parsers = {}  # choice index -> (reasoning splitter or None, tool stream or None)
        counters = {}  # choice index -> its reasoning token counter (or None)
        held = {}  # choice index -> (ids, logprobs) of its tokens whose chunk was skipped
        try:
            # Every choice opens with the assistant role, as OpenAI's stream does (and with
            # the echoed last message, when echo asks for it).
            echoed = echo_prefix(req, req.messages)
            yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                      content=echoed))
                         for i in range(req.n)],
                        make_usage(prompt_tokens, 0) if continuous else None)
            async for _, out in merge_streams(streams, field):
                cached = max(cached, out.num_cached_tokens)
                for o in out.outputs:
                    completion_tokens[o.index] = completion_tokens.get(o.index, 0) + \
                        len(o.token_ids)
                    if o.index not in parsers:
                        parsers[o.index] = (
                            self._splitter(req, prompt_text, thinking_first),
                            ToolCallStream(plan.parser) if plan.parser is not None else None)
                        counters[o.index] = self._counter(prompt_text, thinking_first)
                    if counters[o.index] is not None:
                        counters[o.index].feed(o.token_ids)
                    delta, calls = _delta(*parsers[o.index], o)
                    if (not delta.content and not delta.reasoning_content
                            and not delta.tool_calls and o.finish_reason is None
                            and (not o.token_ids or parsers[o.index] != (None, None))):
                        # As vLLM's: a token the parsers turned into nothing (a tool call's
                        # text before it is whole, a <think> tag) sends no `"delta": {}`
                        # chunk. vLLM drops such a token's logprobs and token_ids; here they
                        # go out with the choice's next chunk.
                        ids, logprobs = held.setdefault(o.index, ([], []))
                        ids.extend(o.token_ids)  # in place: a long call holds every token
                        logprobs.extend(o.logprobs or ())
                        continue
                    if o.index in held:
                        o = _joined(*held.pop(o.index), o)
                    yield chunk([ChatStreamChoice(
                        index=o.index, delta=delta, logprobs=self._logprobs(req, o),
                        finish_reason=_finish_reason(o.finish_reason, o.stop_reason, plan,
                                                     calls),
                        stop_reason=o.stop_reason, **token_ids_fields(req, None, o.token_ids))],
                        # As vLLM's: this choice's own tokens so far.
                        make_usage(prompt_tokens, completion_tokens[o.index])
                        if continuous else None,
                        token_ids_fields(req, out.prompt_token_ids, None).get(
                            "prompt_token_ids") if not prompt_ids_sent else None)
                    prompt_ids_sent = True
            if req.stream_options is not None and req.stream_options.include_usage:
                yield chunk([], make_usage(prompt_tokens, sum(completion_tokens.values()),
                                           cached if self.enable_prompt_tokens_details
                                           else None, total_reasoning_tokens(counters.values())))
        except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band
            yield engine_error_event(e)
        finally:
            abort_unfinished(self.llm, streams)
        yield SSE_DONE


def _finish_reason(reason: str | None, stop_reason: int | str | None, plan: ToolPlan,
                   made_calls: bool) -> str | None:
    """"tool_calls" where calls were made and the answer stopped, as vLLM reports it, except
    where a forced call met a stop string of the client's (stop_reason a str): that cut it
    where the string matched, its arguments most likely short of JSON, so it keeps "stop".
    Calls read under "auto" are whole JSON calls whatever ended the text (a stop string of
    "</tool_call>" too)."""
    if reason != "stop" or not made_calls or not plan.calls_finish:
        return reason
    cut = isinstance(stop_reason, str) and plan.parser is not None and plan.parser.forced
    return reason if cut else "tool_calls"


def _joined(ids: list[int], logprobs: list, then: CompletionOutput) -> CompletionOutput:
    """`then` with the token ids and logprobs of skipped chunks ahead of its own."""
    return replace(then, token_ids=[*ids, *then.token_ids],
                   logprobs=None if then.logprobs is None else [*logprobs, *then.logprobs])


def _delta(splitter, tools: ToolCallStream | None,
           o: CompletionOutput) -> tuple[DeltaMessage, bool]:
    """One streamed output as a delta (reasoning, content, tool-call pieces), and whether
    tool calls were made so far."""
    if splitter is None and tools is None:
        return DeltaMessage(content=o.text), False
    final = o.finish_reason is not None
    reasoning, content = ("", o.text) if splitter is None else splitter.feed(o.text, final)
    calls = []
    if tools is not None:
        content, calls = tools.feed(content, final)
    return DeltaMessage(content=content or None, reasoning_content=reasoning or None,
                        tool_calls=calls or None), tools is not None and tools.num_calls > 0
