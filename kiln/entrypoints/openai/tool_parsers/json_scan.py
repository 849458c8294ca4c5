"""Reading a tool call's JSON object while it is still being generated: its "name" once that
string is whole, and the raw text of its arguments so far (a prefix of their final text).

Pure string scanning, no full parse: streamed deltas are the growth of that raw text.
"""
import json
from dataclasses import dataclass

_WS = " \t\n\r"


@dataclass
class PartialCall:
    name: str | None = None
    args: str = ""  # the arguments' JSON text so far ("{}" for a whole call without any)
    done: bool = False  # the object's closing brace was seen (or the text there is no call)


def not_a_call() -> PartialCall:
    """Where a call was due, text that cannot be one: done, with no name."""
    return PartialCall(done=True)


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """text[i] opens a JSON string: the index after its closing quote, None if not there yet."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def value_end(text: str, i: int, final: bool) -> int | None:
    """The index after the JSON value starting at text[i], None while it may still grow."""
    if i >= len(text):
        return None
    if text[i] == '"':
        return string_end(text, i)
    if text[i] in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # a number, true, false or null: ends at a delimiter (or the end of a final text)
    while j < len(text) and text[j] not in ",}] \t\n\r":
        j += 1
    if j == len(text) and not final:
        return None
    return j if j > i else None


def scan_call(text: str, i: int, args_keys: tuple[str, ...],
              final: bool) -> tuple[PartialCall | None, int | None]:
    """Scan `{"name": ..., "<args key>": ...}` from text[i]: (the call so far, or None when
    the text there is no such object; the index after its closing brace, or None if open).
    JSON's object grammar, member by member: a missing or extra comma is no call."""
    i = skip_ws(text, i)
    call = PartialCall()
    if i >= len(text):
        return call, None
    if text[i] != "{":
        return None, None
    i = skip_ws(text, i + 1)
    if text.startswith("}", i):
        call.done, call.args = True, "{}"
        return call, i + 1
    has_args = False
    while True:  # a member is due at i
        if i >= len(text):
            return call, None
        if text[i] != '"':
            return None, None
        end = string_end(text, i)
        if end is None:
            return call, None
        try:  # a bad escape or a raw control character: not JSON, so no call
            key = json.loads(text[i:end])
        except ValueError:
            return None, None
        i = skip_ws(text, end)
        if i >= len(text):
            return call, None
        if text[i] != ":":
            return None, None
        i = skip_ws(text, i + 1)
        if i >= len(text):
            return call, None
        end = value_end(text, i, final)
        if key in args_keys:
            has_args = True
            call.args = text[i:] if end is None else text[i:end]
        if end is None:
            return call, None
        if key == "name":
            try:
                name = json.loads(text[i:end])
            except ValueError:
                return None, None
            call.name = name if isinstance(name, str) else None
        i = skip_ws(text, end)
        if i >= len(text):
            return call, None
        if text[i] == "}":
            call.done = True
            if not has_args:
                call.args = "{}"
            return call, i + 1
        if text[i] != ",":
            return None, None
        i = skip_ws(text, i + 1)


def partial_suffix(text: str, tag: str) -> int:
    """How many trailing characters of `text` could be the start of `tag` (held back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def scan_calls(text: str, i: int, args_keys: tuple[str, ...], separator: str,
               final: bool) -> list[PartialCall]:
    """Calls from text[i] on, one after another with `separator` between them (`,` inside a
    JSON list, `;` between llama3 calls), up to the first that is open or not a call (then
    not_a_call())."""
    calls: list[PartialCall] = []
    while True:
        call, end = scan_call(text, i, args_keys, final)
        if call is None:
            return calls + [not_a_call()]
        calls.append(call)
        if end is None:
            return calls
        i = skip_ws(text, end)
        if i >= len(text) or text[i] != separator:
            return calls
        i += 1
