"""`StreamItems`: a /v1/responses stream's output items and their events, as OpenAI sends them:
a reasoning item's or the message's text deltas (response.output_item.added,
response.content_part.added, ...delta, ...done, response.content_part.done,
response.output_item.done), and each function call (response.output_item.added,
response.function_call_arguments.delta / .done, response.output_item.done). One item is open
at a time; the next kind of output closes it.
"""
from kiln.entrypoints.openai.response_models import DeltaToolCall
from kiln.entrypoints.openai.responses_objects import (
    EventWriter,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
)
from kiln.entrypoints.openai.responses_tools import FunctionCallItem


class StreamItems:
    def __init__(self, event: EventWriter):
        self.event = event
        self.output: list = []  # items done, then the open one
        self.open = None  # the item deltas go to: (kind, item, its output index)
        self.texts: list[str] = []  # the open item's text so far
        self.calls = 0  # function_call items begun

    def _ids(self) -> dict:
        return dict(item_id=self.open[1].id, output_index=self.open[2])

    def close(self, status: str) -> list[str]:
        """The open item done (none: nothing)."""
        if self.open is None:
            return []
        kind, item, index = self.open
        text = "".join(self.texts)
        self.open = None
        if kind == "function_call":
            item.arguments, item.status = text, status
            return [self.event("response.function_call_arguments.done", item_id=item.id,
                               output_index=index, name=item.name, arguments=text),
                    self.event("response.output_item.done", output_index=index, item=item)]
        part = (ReasoningText if kind == "reasoning" else OutputText)(text=text)
        item.content, item.status = [part], status
        ids = dict(item_id=item.id, output_index=index, content_index=0)
        done = "response.reasoning_text.done" if kind == "reasoning" else \
            "response.output_text.done"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return [self.event(done, **ids, text=text, **extra),
                self.event("response.content_part.done", **ids, part=part),
                self.event("response.output_item.done", output_index=index, item=item)]

    def begin(self, kind: str, name: str | None = None, call_id: str | None = None
              ) -> list[str]:
        """A new item of `kind` (reasoning, message, function_call of `name`, `call_id` if
        given) open, the one open before it completed."""
        events = self.close("completed")
        if kind == "function_call":
            item = FunctionCallItem(name=name, status="in_progress",
                                    **({"call_id": call_id} if call_id else {}))
            self.calls += 1
        else:
            item = ReasoningItem(status="in_progress") if kind == "reasoning" else \
                OutputMessage(status="in_progress")
        self.open = (kind, item, len(self.output))
        self.output.append(item)
        self.texts.clear()
        events.append(self.event("response.output_item.added", output_index=len(self.output) - 1,
                                 item=item))
        if kind != "function_call":
            part = ReasoningText() if kind == "reasoning" else OutputText()
            events.append(self.event("response.content_part.added", **self._ids(),
                                     content_index=0, part=part))
        return events

    def text(self, kind: str, text: str) -> list[str]:
        """Reasoning or message text: to the open item of that kind, else a new one."""
        events = []
        if self.open is None or self.open[0] != kind:
            events += self.begin(kind)
        self.texts.append(text)
        name = "response.reasoning_text.delta" if kind == "reasoning" else \
            "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self.event(name, **self._ids(), content_index=0, delta=text, **extra))
        return events

    def tool_calls(self, deltas: list[DeltaToolCall], own_ids: bool = False) -> list[str]:
        """Chat's tool call deltas (ToolCallStream's): a call's first (its name) begins its
        function_call item (`own_ids`: its call_id the delta's id); its argument pieces are
        deltas of that item."""
        events = []
        for d in deltas:
            if d.function is None:
                continue
            if d.function.name is not None:
                events += self.begin("function_call", d.function.name,
                                     d.id if own_ids else None)
            if d.function.arguments:
                self.texts.append(d.function.arguments)
                events.append(self.event("response.function_call_arguments.delta",
                                         **self._ids(), delta=d.function.arguments))
        return events

    def finish(self, status: str) -> list[str]:
        """The last item closed with the answer's `status` (completed, or incomplete where it
        was cut); an answer of no message and no call gets its empty message."""
        events = []
        if self.calls == 0 and (self.open is None or self.open[0] != "message"):
            events += self.close(status)  # the answer ended while thinking
            events += self.begin("message")
        return events + self.close(status)
