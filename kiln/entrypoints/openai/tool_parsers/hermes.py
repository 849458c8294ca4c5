"""`hermes`: Qwen2.5 / Qwen3 (and Hermes) tool calls, each a JSON object
{"name": ..., "arguments": {...}} between <tool_call> and </tool_call>; content is the text
before the first one."""
from kiln.entrypoints.openai.tool_parsers.base import ToolParser
from kiln.entrypoints.openai.tool_parsers.json_scan import (
    PartialCall,
    ScanMemo,
    not_a_call,
    partial_suffix,
    scan_call,
    skip_ws,
)

START = "<tool_call>"
END = "</tool_call>"


def _end_tag_follows(text: str, i: int) -> bool | None:
    """After a call's closing brace at text[i - 1]: whether only whitespace, then </tool_call>,
    follows; None while the text ends before that is known (the tag, or the start of it, may
    be all that max_tokens left)."""
    j = skip_ws(text, i)
    rest = text[j:j + len(END)]
    if rest == END:
        return True
    return None if END.startswith(rest) else False


class HermesToolParser(ToolParser):
    def parse(self, text: str, final: bool,
              memo: ScanMemo | None = None) -> tuple[str, list[PartialCall]]:
        first = text.find(START)
        if first < 0:
            return (text if final else text[:len(text) - partial_suffix(text, START)]), []
        calls: list[PartialCall] = []
        at = first
        while at >= 0:
            call, end = scan_call(text, at + len(START), ("arguments", "parameters"), final,
                                  memo)
            if call is None:
                calls.append(not_a_call())
                break
            if end is not None:
                closed = _end_tag_follows(text, end)
                if closed is False:  # e.g. an extra brace: the object was not the call
                    calls.append(not_a_call())
                    break
                if closed is None and not final:
                    call.done = False  # whole only once what follows cannot undo it
                    end = None
            calls.append(call)
            if end is None:
                break
            at = text.find(START, end)
        return text[:first], calls
