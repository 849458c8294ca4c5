"""`internlm`: InternLM2 / 2.5 tool calls: one JSON object {"name": ..., "parameters": {...}}
("arguments" read too) between `<|action_start|><|plugin|>` and `<|action_end|>`; content is the
text before it. The markers are special tokens, so the answer is decoded with special tokens
kept (vLLM's adjust_request). As vLLM's, one call per answer: what follows it is not read."""
from kiln.entrypoints.openai.tool_parsers.base import ToolParser
from kiln.entrypoints.openai.tool_parsers.json_scan import (
    PartialCall,
    ScanMemo,
    not_a_call,
    partial_suffix,
    scan_call,
    skip_ws,
)

START = "<|action_start|><|plugin|>"
END = "<|action_end|>"


class InternLMToolParser(ToolParser):
    keeps_special_tokens = True

    def parse(self, text: str, final: bool,
              memo: ScanMemo | None = None) -> tuple[str, list[PartialCall]]:
        first = text.find(START)
        if first < 0:
            return (text if final else text[:len(text) - partial_suffix(text, START)]), []
        call, end = scan_call(text, first + len(START), ("parameters", "arguments"), final,
                              memo)
        if call is None:
            return text[:first], [not_a_call()]
        if end is not None:  # whole once its end marker follows, or the answer ends there
            j = skip_ws(text, end)
            rest = text[j:j + len(END)]
            if rest != END:
                if final and rest or not END.startswith(rest):
                    return text[:first], [not_a_call()]  # text after the object: no call
                if not final:
                    call.done = False
        return text[:first], [call]
