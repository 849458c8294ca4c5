"""Tool-call parsers: hermes and llama3_json read calls and content out of whole answers, and
their streams, cut at every place, reassemble to the same calls; forced (named, required)
answers read the same way; tool_choice plans refuse what cannot work, naming the field."""
import json
import random

import pytest

from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.protocol import ChatCompletionRequest
from kiln.entrypoints.openai.tool_parsers.base import ToolCallStream
from kiln.entrypoints.openai.tool_parsers.forced import NamedToolParser, RequiredToolParser
from kiln.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from kiln.entrypoints.openai.tool_parsers.json_scan import value_end
from kiln.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from kiln.entrypoints.openai.tool_parsers.tool_plan import plan_tools

HERMES = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"q": "a}\\"b{"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}'
          '\n</tool_call>')
LLAMA = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "n": [1, 2]}}; '
         '{"name": "noop", "parameters": {}}')
REQUIRED = ('[{"name": "get_weather", "parameters": {"city": "Oslo"}}, '
            '{"name": "x", "parameters": {"k": true}}]')


def streamed(parser, text: str, rng: random.Random | None = None, step: int = 4):
    """Deltas of 1 to 6 characters (`rng`), else of `step`."""
    stream, content, calls = ToolCallStream(parser), "", {}
    i = 0
    while i <= len(text):  # then once more, final (a call may first go out there)
        j = min(len(text), i + (rng.randint(1, 6) if rng else step))
        c, deltas = stream.feed(text[i:j], final=i == len(text))
        content += c
        for d in deltas:
            call = calls.setdefault(d.index, {"name": None, "arguments": "", "id": None})
            call["id"] = call["id"] or d.id
            call["name"] = call["name"] or d.function.name
            call["arguments"] += d.function.arguments or ""
        i = j if i < len(text) else j + 1
    return content, [calls[k] for k in sorted(calls)]


@pytest.mark.parametrize("parser, text, content, expected", [
    (HermesToolParser(), HERMES, "Let me check.",
     [("get_weather", {"city": "Paris", "q": 'a}"b{'}), ("get_time", {})]),
    (Llama3JsonToolParser(), LLAMA, None,
     [("get_weather", {"city": "Rome", "n": [1, 2]}), ("noop", {})]),
    (RequiredToolParser(), REQUIRED, None,
     [("get_weather", {"city": "Oslo"}), ("x", {"k": True})]),
    (NamedToolParser("f"), ' {"a": [1, {"b": null}]} ', None, [("f", {"a": [1, {"b": None}]})]),
])
def test_whole_and_streamed_agree(parser, text, content, expected):
    got_content, calls = parser.extract(text)
    assert got_content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == expected
    assert len({c.id for c in calls}) == len(calls)
    for seed in range(25):
        s_content, s_calls = streamed(parser, text, random.Random(seed))
        assert (s_content or None) == content
        assert [(c["name"], json.loads(c["arguments"])) for c in s_calls] == expected
        assert all(c["id"] for c in s_calls)


@pytest.mark.parametrize("parser, text", [
    (HermesToolParser(), "no calls here, just <b>text</b> and a < sign"),
    (HermesToolParser(), "<tool_call>\n{not json}\n</tool_call>"),
    (HermesToolParser(), '<tool_call>\n{"name": "f", "arguments": {"a": '),  # cut short
    (Llama3JsonToolParser(), "Plain answer { with a brace"),
    # keys that are no JSON strings (a bad escape, a raw control character)
    (HermesToolParser(), '<tool_call>{"a\\q": 1}</tool_call>'),
    (Llama3JsonToolParser(), '{"C:\\dir": 1}'),
    (Llama3JsonToolParser(), '{"na\tme": "f", "parameters": {}}'),
    # objects outside JSON's grammar: a missing comma, extra commas; text after the object
    (HermesToolParser(), '<tool_call>{"name": "f" "arguments": {}}</tool_call>'),
    (HermesToolParser(), '<tool_call>{,,"name": "f",, "arguments": {}}</tool_call>'),
    (HermesToolParser(), '<tool_call>{"name": "f", "arguments": {},}</tool_call>'),
    (HermesToolParser(), '<tool_call>{"name": "f", "arguments": {}}} junk</tool_call>'),
    (Llama3JsonToolParser(), '{"name": "f" "parameters": {}}'),
    (Llama3JsonToolParser(), '{,"name": "f", "parameters": {}}'),
])
def test_answers_that_are_no_calls_stay_content(parser, text):
    content, calls = parser.extract(text)
    assert calls == [] and content == text


# Answers a model may write under tool_choice "auto": calls, text that only looks like one,
# calls after text, a good call before a broken one.
AUTO_ANSWERS = [
    (HermesToolParser(), [
        HERMES, "I use <tool_call> tags sometimes", "<tool_call>\nnot json at all</tool_call>",
        '<tool_call>{"name": 5, "arguments": {}}</tool_call> then text',
        '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call> after',
        '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call><tool_call>{oops}',
        '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>',
        '<tool_call>{"a\\q": 1}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {}}} junk</tool_call>',
        '<tool_call>{"name": "f", "arguments": {}} \n</tool_call>',
        '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g" "a": 1}']),
    (Llama3JsonToolParser(), [
        LLAMA, '{"foo": 1}', '{"name": 5, "parameters": {}}', ' {"answer": {"x": [1, 2]}}',
        '{"name": "f", "parameters": {"a": 1}} trailing', '{"name": "f", "parameters": {}}; {x}',
        '<|python_tag|>{"name": "f", "parameters": {"a": 1}}', "Plain { answer",
        '{"C:\\dir": 1}']),
]


@pytest.mark.parametrize("parser, text", [(p, t) for p, texts in AUTO_ANSWERS for t in texts])
def test_every_cut_of_an_auto_answer_streams_what_it_holds_whole(parser, text):
    """Wherever max_tokens (or a stop) ends the answer, the stream sent exactly the whole
    answer's content and calls: held-back text that turned out not to be a call is sent as
    content, and no call goes out before it is whole (it might still turn out to be none)."""
    for end in range(len(text) + 1):
        answer = text[:end]
        content, calls = parser.extract(answer)
        s_content, s_calls = streamed(parser, answer, random.Random(end))
        assert (s_content or None) == content, answer
        assert [(c["name"], c["arguments"]) for c in s_calls] == \
            [(c.function.name, c.function.arguments) for c in calls], answer


def test_a_first_call_that_is_none_releases_the_text_before_the_end():
    """Text held back as a possible call goes out once it cannot be one, not at the end."""
    stream = ToolCallStream(HermesToolParser())
    assert stream.feed("I use <tool_call>") == ("I use ", [])
    assert stream.feed(" tags") == ("<tool_call> tags", [])
    stream = ToolCallStream(Llama3JsonToolParser())
    assert stream.feed('{"answer": 1') == ("", [])
    assert stream.feed("}") == ('{"answer": 1}', [])


def test_a_forced_call_cut_short_is_still_the_call_as_it_streams():
    """tool_choice named or required: the grammar wrote a call, which max_tokens cut short;
    the whole answer holds it as the stream did (vLLM's), its arguments the text so far."""
    text = '{"a": '
    content, (call,) = NamedToolParser("f").extract(text)
    stream = ToolCallStream(NamedToolParser("f"))
    _, deltas = stream.feed(text, final=True)
    assert content is None and (call.function.name, call.function.arguments) == ("f", '{"a": ')
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments


@pytest.mark.parametrize("text, arguments", [
    ('{"a": 1}{"a": 1}{"a"', '{"a": 1}'),  # ignore_eos: the model wrote on past the grammar
    (' {"a": "x"} \n\n', '{"a": "x"}'), ('"\n', '"\n'), ('{"a": [1, \n', '{"a": [1, \n')])
def test_a_named_call_is_its_json_value_whole_or_streamed(text, arguments):
    _, (call,) = NamedToolParser("f").extract(text)
    assert call.function.arguments == arguments
    for seed in range(10):
        _, (s_call,) = streamed(NamedToolParser("f"), text, random.Random(seed))
        assert s_call["arguments"] == arguments


@pytest.mark.parametrize("parser, text", [
    (RequiredToolParser(), '[{"na'), (RequiredToolParser(), "["), (NamedToolParser("f"), "  ")])
def test_a_forced_answer_cut_before_its_call_is_no_content_whole_or_streamed(parser, text):
    """Cut before a call's name: no call, and no content either, as the stream sends none."""
    assert parser.extract(text) == (None, [])
    content, calls = streamed(parser, text, random.Random(0))
    assert (content, calls) == ("", [])


def test_a_forced_call_with_an_empty_name_is_none_whole_or_streamed():
    text = '[{"name": "", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'
    assert RequiredToolParser().extract(text) == (None, [])
    assert streamed(RequiredToolParser(), text, random.Random(0)) == ("", [])


def test_a_named_call_with_nothing_written_is_no_call_whole_or_streamed():
    """All the answer was thinking (the grammar waited for </think>): no call, and the stream
    announces none either."""
    assert NamedToolParser("f").extract("") == (None, [])
    stream = ToolCallStream(NamedToolParser("f"))
    assert stream.feed("") == ("", []) and stream.feed("", final=True) == ("", [])


@pytest.mark.parametrize("parser, opening, closing", [
    (HermesToolParser(), '<tool_call>{"name": "write", "arguments": ', "}</tool_call>"),
    (Llama3JsonToolParser(), '{"name": "write", "parameters": ', "}"),
    (RequiredToolParser(), '[{"name": "write", "parameters": ', "}]"),
])
def test_a_long_call_streams_as_it_reads_whole(parser, opening, closing):
    """40K characters of code in a string argument, 4 at a time (escapes split at every
    place): each delta resumes the open value's scan, and the calls come out whole."""
    code = "def f(x):\n    return {'a': [x, \"q\\\\\"]}\n" * 1000
    args = json.dumps({"path": "a.py", "content": code})
    text = opening + args + closing
    _, (call,) = parser.extract(text)
    for step in (3, 4):
        _, (s_call,) = streamed(parser, text, step=step)
        assert (s_call["name"], s_call["arguments"]) == ("write", call.function.arguments)
    assert json.loads(call.function.arguments)["content"] == code


def test_a_scan_resumes_after_an_escape_cut_at_its_backslash():
    memo: dict = {}
    assert value_end('{"a": "x\\', 0, False, memo) is None
    assert value_end('{"a": "x\\"', 0, False, memo) is None  # an escaped quote, not the end
    assert value_end('{"a": "x\\""', 0, False, memo) is None
    assert value_end('{"a": "x\\""}', 0, False, memo) == 12
    assert value_end('{"a": "x\\""} ', 0, False, memo) == 12  # read whole before


def test_hermes_stream_holds_back_a_split_tag():
    stream = ToolCallStream(HermesToolParser())
    assert stream.feed("Hi <tool_") == ("Hi ", [])
    content, deltas = stream.feed('call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>')
    assert content == "" and deltas[0].function.name == "f" and deltas[0].id
    assert json.loads(deltas[0].function.arguments) == {"x": 1}


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}}]


def req(**kw):
    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **kw)


def test_tool_choice_plans():
    assert plan_tools(req(), None, False).parser is None
    plan = plan_tools(req(tools=TOOLS, tool_choice="none"), None, False)
    assert plan.template_tools[0]["function"]["name"] == "f" and plan.parser is None
    plan = plan_tools(req(tools=TOOLS), "hermes", True)  # no tool_choice with tools: auto
    assert isinstance(plan.parser, HermesToolParser) and plan.constraint is None
    plan = plan_tools(req(tools=TOOLS, tool_choice="required"), None, False)
    assert plan.constraint.json["minItems"] == 1 and plan.calls_finish
    plan = plan_tools(req(tools=TOOLS, tool_choice={"type": "function",
                                                     "function": {"name": "f"}}), None, False)
    assert plan.constraint.json == TOOLS[0]["function"]["parameters"]
    assert not plan.calls_finish  # a named call finishes with "stop", as OpenAI's


@pytest.mark.parametrize("kw, flags, message", [
    ({"tools": TOOLS}, (None, False), "--enable-auto-tool-choice"),
    ({"tools": TOOLS, "tool_choice": "auto"}, ("hermes", False), "--enable-auto-tool-choice"),
    ({"tool_choice": "required"}, (None, False), "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}},
     (None, False), "not among tools"),
])
def test_tool_choice_refusals_name_tool_choice(kw, flags, message):
    with pytest.raises(OpenAIError, match=message) as e:
        plan_tools(req(**kw), *flags)
    assert e.value.param == "tool_choice"


def test_cli_parser_names_match_the_registries():
    from kiln.entrypoints.cli.serve import REASONING_PARSER_NAMES, TOOL_CALL_PARSER_NAMES
    from kiln.entrypoints.openai.tool_parsers import TOOL_PARSERS
    from kiln.reasoning import REASONING_PARSERS

    assert TOOL_CALL_PARSER_NAMES == sorted(TOOL_PARSERS)
    assert REASONING_PARSER_NAMES == sorted(REASONING_PARSERS)
