"""`mistral`: Mistral 7B Instruct v0.3 (and later models with Hugging Face tokenizers) tool
calls: `[TOOL_CALLS]` then a JSON list of {"name": ..., "arguments": {...}} objects ("parameters"
read too, as hermes reads it); content is the text before it. `[TOOL_CALLS]` is a special token,
so the answer is decoded with special tokens kept (vLLM's adjust_request); call ids are 9
alphanumerics, as mistral_common requires of the ids the next request sends back."""
import random
import string

from kiln.entrypoints.openai.tool_parsers.base import ToolParser
from kiln.entrypoints.openai.tool_parsers.json_scan import (
    PartialCall,
    ScanMemo,
    not_a_call,
    partial_suffix,
    scan_calls,
    skip_ws,
)

BOT = "[TOOL_CALLS]"
_ALPHANUMERIC = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    keeps_special_tokens = True
    template_checks_ids = True

    def new_id(self) -> str:
        return "".join(random.choices(_ALPHANUMERIC, k=9))

    def parse(self, text: str, final: bool,
              memo: ScanMemo | None = None) -> tuple[str, list[PartialCall]]:
        first = text.find(BOT)
        if first < 0:
            return (text if final else text[:len(text) - partial_suffix(text, BOT)]), []
        i = skip_ws(text, first + len(BOT))
        if i == len(text):
            return text[:first], [not_a_call()] if final else [PartialCall()]
        if text[i] != "[":
            return text[:first], [not_a_call()]
        return text[:first], scan_calls(text, i + 1, ("arguments", "parameters"), ",", final,
                                          memo)
