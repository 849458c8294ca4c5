"""`mistral`: Mistral tool calls, both formats vLLM reads: `[TOOL_CALLS]` then a JSON list of
{"name": ..., "arguments": {...}} objects (Mistral 7B Instruct v0.3; "parameters" read too, as
hermes reads it), or, from the v11 tokenizers on, `[TOOL_CALLS]name{...}` per call (`[ARGS]`
between name and arguments where the tokenizer has it); content is the text before the first.
`[TOOL_CALLS]` is a special token, so the answer is decoded with special tokens kept (vLLM's
adjust_request); call ids are 9 alphanumerics, as mistral_common requires of the ids the next
request sends back."""
import random
import re
import string

from kiln.entrypoints.openai.tool_parsers.base import ToolParser
from kiln.entrypoints.openai.tool_parsers.json_scan import (
    PartialCall,
    ScanMemo,
    not_a_call,
    partial_suffix,
    scan_calls,
    skip_ws,
    value_end,
)

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"[^{\[]*")  # a v11 call's name runs to its arguments (or [ARGS])
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
        if text[i] != "[":  # no name starts with "[": a v11 call
            return text[:first], named_calls(text, first, final, memo)
        return text[:first], scan_calls(text, i + 1, ("arguments", "parameters"), ",", final,
                                          memo)


def named_calls(text: str, at: int, final: bool, memo: ScanMemo | None) -> list[PartialCall]:
    """v11 calls from the marker at text[at]: `[TOOL_CALLS]name{...}` (or `name[ARGS]{...}`)
    one after another, up to the first that is open or not a call (then not_a_call())."""
    calls: list[PartialCall] = []
    n = len(text)
    while True:
        i = _NAME.match(text, at + len(BOT)).end()
        if i == n:  # the name may still grow
            return calls + [not_a_call() if final else PartialCall()]
        name = text[at + len(BOT):i].strip()
        if not name or any(c.isspace() for c in name) or '"' in name:
            return calls + [not_a_call()]
        if text.startswith("[", i):
            if text.startswith(ARGS, i):
                i += len(ARGS)
            elif ARGS.startswith(text[i:]) and not final:
                return calls + [PartialCall(name=name)]
            else:
                return calls + [not_a_call()]
        i = skip_ws(text, i)
        if i == n:
            return calls + [not_a_call() if final else PartialCall(name=name)]
        if text[i] != "{":
            return calls + [not_a_call()]
        end = value_end(text, i, final, memo)
        if end is None:
            return calls + [PartialCall(name=name, args=text[i:])]
        calls.append(PartialCall(name=name, args=text[i:end], done=True))
        at = skip_ws(text, end)
        if not text.startswith(BOT, at):  # the calls end (a marker may still be coming)
            return calls
