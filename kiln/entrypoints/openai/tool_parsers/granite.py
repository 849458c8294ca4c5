"""`granite`: IBM Granite 3.0 / 3.1 tool calls: the answer is (after `<|tool_call|>` or
`<tool_call>`) a JSON list of {"name": ..., "arguments": {...}} objects and nothing else, else
it is all content. As vLLM's, the list is read whole (json.loads of the rest of the answer):
text after it, or a member that is no call, makes the whole answer content, so a stream holds
the calls until the answer ends."""
import json

from kiln.entrypoints.openai.tool_parsers.base import ToolParser
from kiln.entrypoints.openai.tool_parsers.json_scan import (
    PartialCall,
    ScanMemo,
    not_a_call,
    skip_ws,
    value_end,
)

MARKERS = ("<|tool_call|>", "<tool_call>")  # 3.0's special token, 3.1's text


def _calls(text: str) -> list[PartialCall]:
    try:
        members = json.loads(text)
    except (ValueError, RecursionError):
        return [not_a_call()]
    if not isinstance(members, list) or not members or not all(
            isinstance(m, dict) and isinstance(m.get("name"), str) and "arguments" in m
            for m in members):
        return [not_a_call()]
    return [PartialCall(name=m["name"], args=json.dumps(m["arguments"], ensure_ascii=False),
                        done=True) for m in members]


class GraniteToolParser(ToolParser):
    def parse(self, text: str, final: bool,
              memo: ScanMemo | None = None) -> tuple[str, list[PartialCall]]:
        i = skip_ws(text, 0)
        for marker in MARKERS:
            if text.startswith(marker, i):
                i = skip_ws(text, i + len(marker))
            elif not final and marker.startswith(text[i:]):
                return "", []  # only whitespace or the start of a marker so far: undecided
        if i == len(text):
            return (text if final else ""), []
        if text[i] != "[":
            return text, []
        end = value_end(text, i, final, memo)
        if end is not None and text[end:].strip():
            return "", [not_a_call()]  # text after the list: no JSON list, all content
        if not final:
            return "", [PartialCall()]  # whole only at the end (text may yet follow)
        return "", _calls(text[i:end]) if end is not None else [not_a_call()]
