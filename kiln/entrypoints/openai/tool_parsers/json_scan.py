"""Reading a tool call's JSON object while it is still being generated: its "name" once that
string is whole, and the raw text of its arguments so far (a prefix of their final text).

Pure string scanning, no full parse: streamed deltas are the growth of that raw text.
"""
import json
import re
from dataclasses import dataclass

# A stream re-reads its whole text on every delta, so scanning runs at C speed (regex searches,
# not a Python loop per character), and a value still open resumes where the last read ended
# (a ScanMemo): a 40K-character call streamed 4 characters at a time took 16 s, now well
# under one.
_WS = re.compile(r"[ \t\n\r]*")
_STRUCTURAL = re.compile(r'[][{}"]')  # outside strings: what changes the nesting
_IN_STRING = re.compile(r'["\\]')  # inside a string: its end, or an escape
_SCALAR = re.compile(r"[^,}\] \t\n\r]*")  # a number, true, false or null

# A value's start index -> (where its scan resumes, nesting depth there, inside a string).
# The owner's text only grows (a stream's), so what was read stays read.
ScanMemo = dict[int, tuple[int, int, bool]]


@dataclass
class PartialCall:
    name: str | None = None
    args: str = ""  # the arguments' JSON text so far ("{}" for a whole call without any)
    done: bool = False  # the object's closing brace was seen (or the text there is no call)


def not_a_call() -> PartialCall:
    """Where a call was due, text that cannot be one: done, with no name."""
    return PartialCall(done=True)


def skip_ws(text: str, i: int) -> int:
    return _WS.match(text, i).end()


def value_end(text: str, i: int, final: bool, memo: ScanMemo | None = None) -> int | None:
    """The index after the JSON value starting at text[i], None while it may still grow.
    A string, object or array resumes from `memo` (where given) and leaves its state there."""
    n = len(text)
    if i >= n:
        return None
    if text[i] not in '"{[':
        j = _SCALAR.match(text, i).end()  # ends at a delimiter (or the end of a final text)
        if j == n and not final:
            return None
        return j if j > i else None
    pos, depth, in_string = memo.get(i, (i, 0, False)) if memo is not None else (i, 0, False)
    if pos > i and depth == 0 and not in_string:
        return pos  # read whole before
    end = None
    while end is None:
        if in_string:
            m = _IN_STRING.search(text, pos)
            if m is None:
                pos = n
                break
            j = m.start()
            if text[j] == "\\":
                if j + 1 == n:  # the escaped character is not here yet: resume at the "\\"
                    pos = j
                    break
                pos = j + 2
                continue
            in_string, pos = False, j + 1
            if depth == 0:  # the value was this string
                end = pos
            continue
        m = _STRUCTURAL.search(text, pos)
        if m is None:
            pos = n
            break
        c, pos = m.group(), m.end()
        if c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                end = pos
    if memo is not None:
        memo[i] = (pos, depth, in_string)
    return end


def scan_call(text: str, i: int, args_keys: tuple[str, ...], final: bool,
              memo: ScanMemo | None = None) -> tuple[PartialCall | None, int | None]:
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
        end = value_end(text, i, final, memo)
        if end is None:
            return call, None
        try:  # a bad escape or a raw control character: not JSON, so no call
            key = json.loads(text[i:end])
        except (ValueError, RecursionError):
            return None, None
        i = skip_ws(text, end)
        if i >= len(text):
            return call, None
        if text[i] != ":":
            return None, None
        i = skip_ws(text, i + 1)
        if i >= len(text):
            return call, None
        end = value_end(text, i, final, memo)
        if key in args_keys:
            has_args = True
            call.args = text[i:] if end is None else text[i:end]
        if end is None:
            return call, None
        if key == "name":
            try:
                name = json.loads(text[i:end])
            except (ValueError, RecursionError):
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
    """Whether `text` is JSON that json.loads reads: nested past its recursion limit (a model
    that wrote "[" a thousand times) it is none, not a crash of the request."""
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def scan_calls(text: str, i: int, args_keys: tuple[str, ...], separator: str,
               final: bool, memo: ScanMemo | None = None) -> list[PartialCall]:
    """Calls from text[i] on, one after another with `separator` between them (`,` inside a
    JSON list, `;` between llama3 calls), up to the first that is open or not a call (then
    not_a_call())."""
    calls: list[PartialCall] = []
    while True:
        call, end = scan_call(text, i, args_keys, final, memo)
        if call is None:
            return calls + [not_a_call()]
        calls.append(call)
        if end is None:
            return calls
        i = skip_ws(text, end)
        if i >= len(text) or text[i] != separator:
            return calls
        i += 1
