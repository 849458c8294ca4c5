"""`ToolParser`: reads tool calls out of a model's text; `ToolCallStream` turns the same reading
of a growing text into OpenAI's streamed deltas, so streamed and whole answers agree.
"""
import itertools
import uuid

from kiln.entrypoints.openai.response_models import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from kiln.entrypoints.openai.tool_parsers.json_scan import PartialCall, ScanMemo, is_json


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolParser:
    """parse(text, final) -> (content so far, calls so far); content never shrinks as the text
    grows (a possible start of a tool-call marker is held back until `final`). `max_calls`
    (parallel_tool_calls=false): calls past it are dropped. `memo`: a stream's, kept across
    its growing texts so that open values resume their scan (None for a whole answer)."""

    max_calls: int | None = None
    # The answer's shape is forced by a grammar (tool_choice required or named): its calls are
    # calls even when max_tokens cut their arguments short, as they stream (and as vLLM's are).
    forced = False
    # The request's tools (ChatCompletionToolsParam), for parsers that read arguments by their
    # schema (qwen3_coder's parameter types); set by plan_tools.
    tools: tuple = ()
    # The call marker is a special token (mistral's [TOOL_CALLS]): decode with special tokens
    # kept, as vLLM's adjust_request does, or the answer never shows it.
    keeps_special_tokens = False
    # Its call ids have a format the model's chat template checks when the calls come back
    # (mistral's raises on ids not 9 alphanumerics): /v1/responses sends them as call_ids,
    # not OpenAI's call_... ones.
    template_checks_ids = False

    def new_id(self) -> str:
        """A call's id (vLLM's format for the parser: mistral's are 9 alphanumerics)."""
        return tool_call_id()

    def parse(self, text: str, final: bool,
              memo: ScanMemo | None = None) -> tuple[str, list[PartialCall]]:
        raise NotImplementedError

    def calls(self, text: str, final: bool,
              memo: ScanMemo | None = None) -> tuple[str, list[PartialCall]]:
        content, calls = self.parse(text, final, memo)
        return content, calls if self.max_calls is None else calls[:self.max_calls]

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole answer: (content or None, tool calls). Unforced, the calls are the leading
        run of whole, named, JSON ones; an answer whose first call is not one (a model that
        did not follow the format, or max_tokens cut it) is all content. A forced answer is
        calls only, so what it wrote before a call's name (max_tokens cut it there) is neither:
        its stream sends no content, and vLLM's is empty too."""
        content, calls = self.calls(text, final=True)
        if self.forced:
            # A name not yet written (or empty): no call yet, nor any after it, as streamed.
            calls = list(itertools.takewhile(lambda c: c.name, calls))
        else:
            calls = complete_calls(calls)
            if not calls:
                return text or None, []
        return content or None, [ToolCall(id=self.new_id(), function=FunctionCall(
            name=c.name, arguments=c.args)) for c in calls]


def complete_calls(calls: list[PartialCall]) -> list[PartialCall]:
    """The leading calls that are whole, named and JSON: fixed once seen, as the text grows."""
    n = 0
    while n < len(calls) and calls[n].done and calls[n].name and is_json(calls[n].args):
        n += 1
    return calls[:n]


class ToolCallStream:
    """Feed text deltas; get (content delta, tool call deltas) in OpenAI's stream shape."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self._content_sent = 0
        self._args_sent: list[int] = []  # per call whose header (id, name) went out
        self._memo: ScanMemo = {}

    @property
    def num_calls(self) -> int:
        return len(self._args_sent)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[DeltaToolCall]]:
        self.text += delta
        content, calls = self.parser.calls(self.text, final, self._memo)
        if not self.parser.forced:
            # Only what the whole answer will hold goes out (extract's rule): a call once it is
            # whole; the text held back as a possible call once its first call is none.
            first_done = bool(calls) and calls[0].done
            calls = complete_calls(calls)
            if not calls and (final or first_done):
                content = self.text  # its first call is none: all of it is content
        new_content = content[self._content_sent:]
        self._content_sent = max(self._content_sent, len(content))
        deltas: list[DeltaToolCall] = []
        for i, call in enumerate(calls):
            if i == len(self._args_sent):
                if not call.name:
                    break  # the name comes first in the stream; wait for it
                self._args_sent.append(0)
                deltas.append(DeltaToolCall(index=i, id=self.parser.new_id(), type="function",
                                            function=DeltaFunctionCall(name=call.name,
                                                                       arguments="")))
            piece = call.args[self._args_sent[i]:]
            if piece:
                self._args_sent[i] = len(call.args)
                if deltas and deltas[-1].index == i:
                    deltas[-1].function.arguments += piece
                else:
                    deltas.append(DeltaToolCall(index=i, function=DeltaFunctionCall(
                        arguments=piece)))
        return new_content, deltas
