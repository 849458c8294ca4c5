"""`hermes`: Qwen2.5 / Qwen3 (and Hermes) tool calls, each a JSON object
{"name": ..., "arguments": {...}} between <tool_call> and </tool_call>; content is the text
before the first one."""
from kiln.entrypoints.openai.tool_parsers.base import ToolParser
from kiln.entrypoints.openai.tool_parsers.json_scan import (
    PartialCall,
    not_a_call,
    partial_suffix,
    scan_call,
)

START = "<tool_call>"


class HermesToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> tuple[str, list[PartialCall]]:
        first = text.find(START)
        if first < 0:
            return (text if final else text[:len(text) - partial_suffix(text, START)]), []
        calls: list[PartialCall] = []
        at = first
        while at >= 0:
            call, end = scan_call(text, at + len(START), ("arguments", "parameters"), final)
            if call is None:
                calls.append(not_a_call())
                break
            calls.append(call)
            if end is None:
                break
            at = text.find(START, end)
        return text[:first], calls
