"""`llama3_json`: Llama 3.x JSON tool calls: the answer is (after an optional <|python_tag|>)
one or more {"name": ..., "parameters": {...}} objects separated by ";", else plain content."""
from kiln.entrypoints.openai.tool_parsers.base import ToolParser
from kiln.entrypoints.openai.tool_parsers.json_scan import (
    PartialCall,
    ScanMemo,
    scan_calls,
    skip_ws,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    def parse(self, text: str, final: bool,
              memo: ScanMemo | None = None) -> tuple[str, list[PartialCall]]:
        i = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not final and len(text) - i < len(PYTHON_TAG) and PYTHON_TAG.startswith(text[i:]):
            return "", []  # only whitespace or the start of the tag so far: undecided
        if i >= len(text):
            return ("" if not final else text), []
        if text[i] != "{":
            return text, []
        return "", scan_calls(text, i, ("parameters", "arguments"), ";", final, memo)
