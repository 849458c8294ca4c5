"""`pythonic`: Llama 3.2 / Llama 4 (and ToolACE) tool calls written as a Python list of calls,
`[get_weather(city="SF"), f(x=1)]`, keyword arguments only, their values Python literals (read
with `ast`, never evaluated). As vLLM's: the answer is either that list and nothing else (its
calls, no content) or all content; a list with any element that is no such call is content.

A stream finds where each element ends by scanning brackets and Python strings (resuming where
its last read stopped), and holds the calls until the answer ends: text after the list would
make it all content."""
import ast
import json
import re
from dataclasses import dataclass, field

from kiln.entrypoints.openai.tool_parsers.base import ToolParser
from kiln.entrypoints.openai.tool_parsers.json_scan import (
    PartialCall,
    ScanMemo,
    not_a_call,
    skip_ws,
)

_OUTSIDE = re.compile(r"""[][(){}"',#]""")  # outside strings: what the scan acts on
_NAME = re.compile(r"[A-Za-z_]\w*")
_CLOSE = {")": "(", "]": "[", "}": "{"}
_MEMO_KEY = -1  # where a stream's scan state sits in its ScanMemo (value indices are >= 0)


class _NotACall(Exception):
    pass


@dataclass
class _Scan:
    """Where the scan of the list stands: resumes at `pos` as the text grows."""
    pos: int
    elem_start: int
    stack: str = "["  # open brackets, the list's own first
    quote: str = ""  # the open string's quote (', ", ''' or \"\"\"), "" outside strings
    calls: list = field(default_factory=list)  # the elements read whole, as PartialCalls
    closed_at: int | None = None  # the index after the list's "]"
    bad: bool = False


def _literal(node: ast.expr):
    """A JSON value from a literal: constants (a signed number too), lists, tuples, dicts."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(
            node.value, (str, bool, int, float))):
        return node.value
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd))
            and isinstance(node.operand, ast.Constant)
            and type(node.operand.value) in (int, float)):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None or not isinstance(k, ast.Constant) for k in node.keys):
            raise _NotACall("dict keys must be literals")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    raise _NotACall("arguments must be literals")


def _call(source: str) -> PartialCall:
    """One element of the list, `name(key=literal, ...)`, as a whole call."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args \
                or any(k.arg is None for k in node.keywords):
            raise _NotACall("not name(key=value, ...)")
        args = {k.arg: _literal(k.value) for k in node.keywords}
        text = json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (_NotACall, SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return not_a_call()
    return PartialCall(name=node.func.id, args=text, done=True)


def _end_element(text: str, s: _Scan, end: int) -> None:
    call = _call(text[s.elem_start:end])
    if call.name is None:
        s.bad = True
    else:
        s.calls.append(call)
    s.elem_start = end + 1


def _scan(text: str, s: _Scan, final: bool) -> None:
    """Advance `s` over text[s.pos:], stopping early where a string's end or escape is cut."""
    n = len(text)
    while not s.bad and s.closed_at is None and s.pos < n:
        if s.quote:
            j = text.find(s.quote[0], s.pos)
            k = text.find("\\", s.pos, n if j < 0 else j)
            if k >= 0:  # an escape first: skip the escaped character
                if k + 1 == n and not final:
                    return
                s.pos = k + 2
                continue
            if j < 0:
                s.pos = n
                return
            if len(s.quote) == 3 and text[j:j + 3] != s.quote:
                if j + 3 > n and not final and s.quote.startswith(text[j:]):
                    s.pos = j  # maybe the closing quotes, cut
                    return
                s.pos = j + 1
                continue
            s.pos, s.quote = j + len(s.quote), ""
            continue
        m = _OUTSIDE.search(text, s.pos)
        if m is None:
            s.pos = n
            return
        c, j = m.group(), m.start()
        if c in "\"'":
            if not final and j + 3 > n and text[j:] == c * (n - j):
                s.pos = j  # one quote or a triple one: the next characters tell
                return
            s.quote = c * 3 if text.startswith(c * 3, j) else c
            s.pos = j + len(s.quote)
            continue
        s.pos = j + 1
        at_top = s.stack == "["
        if c == "#":
            s.bad = True
        elif c in "([{":
            # At the list's level only a call opens: the name before "(" is the function's.
            if at_top and not (c == "(" and _NAME.fullmatch(text[s.elem_start:j].strip())):
                s.bad = True
            s.stack += c
        elif c == ",":
            if at_top:
                _end_element(text, s, j)
        elif not s.stack or s.stack[-1] != _CLOSE[c]:
            s.bad = True
        else:
            s.stack = s.stack[:-1]
            if not s.stack:  # the list's own "]"
                _end_element(text, s, j)
                s.closed_at = j + 1


class PythonicToolParser(ToolParser):
    def parse(self, text: str, final: bool,
              memo: ScanMemo | None = None) -> tuple[str, list[PartialCall]]:
        i = skip_ws(text, 0)
        if i == len(text):
            return (text if final else ""), []
        if text[i] != "[":
            return text, []
        # The scan state rides in the stream's memo under a key no value index uses.
        s = memo.get(_MEMO_KEY) if memo is not None else None
        if s is None:
            s = _Scan(pos=i + 1, elem_start=i + 1)
            if memo is not None:
                memo[_MEMO_KEY] = s  # type: ignore[assignment]
        _scan(text, s, final)
        if not s.bad and s.closed_at is not None and text[s.closed_at:].strip():
            s.bad = True  # text after the list: the answer is no list of calls
        if s.bad or (final and s.closed_at is None):
            return "", [not_a_call()]
        if not final:
            return "", [PartialCall()]  # whole only at the end (text may yet follow)
        return "", list(s.calls)
