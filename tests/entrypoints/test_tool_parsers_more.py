"""vLLM's pythonic, mistral, qwen3_coder, granite and internlm tool-call parsers: calls and
content out of whole answers; streams cut at every place (and token by token with a real
tokenizer) reassemble to the same calls, their arguments the same JSON text; what is no call
stays content."""
import json
import random
import re

import pytest
from test_tool_parsers import streamed

from kiln.entrypoints.openai.protocol import ChatCompletionRequest
from kiln.entrypoints.openai.tool_parsers import TOOL_PARSERS
from kiln.entrypoints.openai.tool_parsers.base import ToolCallStream
from kiln.entrypoints.openai.tool_parsers.granite import GraniteToolParser
from kiln.entrypoints.openai.tool_parsers.internlm import InternLMToolParser
from kiln.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from kiln.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from kiln.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from kiln.entrypoints.openai.tool_parsers.tool_plan import plan_tools

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
        "metric": {"type": "boolean"}, "opts": {"type": "object"},
        "tags": {"type": "array"}, "either": {"type": ["string", "null"]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def qwen3_coder() -> Qwen3CoderToolParser:
    """The parser as the server makes it for a request with TOOLS (tool_choice auto)."""
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    return plan_tools(req, "qwen3_coder", True).parser


PYTHONIC = ('[get_weather(city="São Paulo", days=-3, opts={"a": [1, 2.5, None], \'b\': True}, '
            "q='it\\'s ]) \"x\"', t=(1, 2)), get_time(), f(s=\"\"\"multi\nline\"\"\")]")
MISTRAL = ('Checking.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Zürich", '
           '"q": "a}]\\"["}}, {"name": "get_time", "arguments": {}}]')
# the v11 tokenizers' format: each call its marker and name, [ARGS] where the tokenizer has it
MISTRAL_V11 = ('Checking.[TOOL_CALLS]get_weather{"city": "Zürich", "q": "a}]\\"[{"}'
               '[TOOL_CALLS]get_time[ARGS]{}')
QWEN3_CODER = ("Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n東京 "
               "<b>\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=temp>\n2.5\n"
               "</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=opts>\n"
               '{"k": [1, {"n": null}]}\n</parameter>\n<parameter=tags>\n[\'a\', "b"]\n'
               "</parameter>\n<parameter=other>\n7\n</parameter>\n</function>\n</tool_call>\n"
               "<tool_call>\n<function=get_time>\n</function>\n</tool_call>")
GRANITE = (' <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Ærø", "q": "]\\"}"}}, '
           '{"name": "get_time", "arguments": {}}] ')
INTERNLM = ('Let me see.<|action_start|><|plugin|>\n{"name": "get_weather", "parameters": '
            '{"city": "Kraków", "n": [1, {"x": "}<|action_end|>"}]}}<|action_end|>')

EXPECTED = {
    "granite": (GraniteToolParser, GRANITE, None, [
        ("get_weather", {"city": "Ærø", "q": ']"}'}), ("get_time", {})]),
    "internlm": (InternLMToolParser, INTERNLM, "Let me see.", [
        ("get_weather", {"city": "Kraków", "n": [1, {"x": "}<|action_end|>"}]})]),
    "pythonic": (PythonicToolParser, PYTHONIC, None, [
        ("get_weather", {"city": "São Paulo", "days": -3, "opts": {"a": [1, 2.5, None],
                                                                   "b": True},
                         "q": "it's ]) \"x\"", "t": [1, 2]}),
        ("get_time", {}), ("f", {"s": "multi\nline"})]),
    "mistral": (MistralToolParser, MISTRAL, "Checking.", [
        ("get_weather", {"city": "Zürich", "q": 'a}]"['}), ("get_time", {})]),
    "mistral_v11": (MistralToolParser, MISTRAL_V11, "Checking.", [
        ("get_weather", {"city": "Zürich", "q": 'a}]"[{'}), ("get_time", {})]),
    "qwen3_coder": (qwen3_coder, QWEN3_CODER, "Let me look.\n", [
        ("get_weather", {"city": "東京 <b>", "days": 3, "temp": 2.5, "metric": True,
                         "opts": {"k": [1, {"n": None}]}, "tags": ["a", "b"], "other": "7"}),
        ("get_time", {})]),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_whole_and_streamed_agree(name):
    make, text, content, expected = EXPECTED[name]
    got_content, calls = make().extract(text)
    assert got_content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == expected
    for seed in range(20):
        s_content, s_calls = streamed(make(), text, random.Random(seed))
        assert (s_content or None) == content
        assert [(c["name"], c["arguments"]) for c in s_calls] == \
            [(c.function.name, c.function.arguments) for c in calls]
        assert all(c["id"] for c in s_calls)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from checkpoints import save_chat_tokenizer

    path = tmp_path_factory.mktemp("chat_tokenizer")
    save_chat_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_token_by_token_with_a_real_tokenizer(name, tok):
    """Deltas as a byte-level BPE tokenizer's detokenizer makes them (the test chat one)."""
    make, text, content, expected = EXPECTED[name]
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text
    stream, got, calls, sent = ToolCallStream(make()), "", {}, ""
    for k in range(len(ids) + 1):
        now = tok.decode(ids[:k])
        if now.endswith("\ufffd") and k < len(ids):
            continue  # a character cut between tokens: the detokenizer holds it
        c, deltas = stream.feed(now[len(sent):], final=k == len(ids))
        sent, got = now, got + c
        for d in deltas:
            call = calls.setdefault(d.index, ["", ""])
            call[0] += d.function.name or ""
            call[1] += d.function.arguments or ""
    assert (got or None) == content
    assert [(n, json.loads(a)) for n, a in calls.values()] == expected


def test_mistral_ids_are_nine_alphanumerics():
    _, calls = MistralToolParser().extract(MISTRAL)
    _, s_calls = streamed(MistralToolParser(), MISTRAL, random.Random(0))
    for call_id in [c.id for c in calls] + [c["id"] for c in s_calls]:
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call_id)
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("value, schema, expected", [
    ("null", {"type": "integer"}, None), ("None", {"type": "object"}, None),
    ("null", {"type": "string"}, "null"),
    ("None", {"anyOf": [{"type": "string"}, {"type": "null"}]}, None),
    ("5", {"anyOf": [{"type": "null"}, {"type": "integer"}]}, 5),
    ('"{\'a\': 1}"', {"type": "object"}, {"a": 1}), ("42", {"type": "integer"}, 42),
    ("4x", {"type": "integer"}, "4x"), ("3.0", {"type": "number"}, 3),
    ("1e400", {"type": "number"}, "1e400"), ("nan", {"type": "number"}, "nan"),
    ("FALSE", {"type": "boolean"}, False), ("yes", {"type": "boolean"}, False),
    ('{"a": 1}', {"type": "object"}, {"a": 1}), ("{'a': (1,)}", {"type": "object"}, {"a": [1]}),
    ("[1, 2", {"type": "array"}, "[1, 2"), ("007", {"type": "string"}, "007"),
    ("007", {}, "007"), ("[1]", {"type": "custom"}, [1]),
    ("__import__('os')", {"type": "object"}, "__import__('os')"),  # read, never run
])
def test_qwen3_coder_converts_values_by_their_schema_type(value, schema, expected):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": schema}}}}]
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=tools)
    parser = plan_tools(req, "qwen3_coder", True).parser
    text = f"<tool_call>\n<function=f>\n<parameter=p>\n{value}\n</parameter>\n</function>"
    _, (call,) = parser.extract(text)
    assert json.loads(call.function.arguments) == {"p": expected}


@pytest.mark.parametrize("text, expected", [
    # end tags inside a value are text where the next tag does not follow them (code, HTML)
    ("<tool_call>\n<function=w>\n<parameter=code>\nx = '</parameter>' + '</function>'\n"
     "</parameter>\n<parameter=n>\n1\n</parameter>\n</function>\n</tool_call>",
     [("w", {"code": "x = '</parameter>' + '</function>'", "n": "1"})]),
    # a missing </parameter>: the next parameter (or the function's end) ends the value
    ("<function=f>\n<parameter=a>\n1\n<parameter=b>\n2</parameter>\n</function>",
     [("f", {"a": "1", "b": "2"})]),
    ("<tool_call>\n<function=a>\n<parameter=x>\n1\n</function>\n<function=b>\n</function>",
     [("a", {"x": "1"}), ("b", {})]),
])
def test_qwen3_coder_reads_structure_not_tags_in_values(text, expected):
    _, calls = Qwen3CoderToolParser().extract(text)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == expected
    for seed in range(5):
        _, s_calls = streamed(Qwen3CoderToolParser(), text, random.Random(seed))
        assert [(c["name"], c["arguments"]) for c in s_calls] == \
            [(c.function.name, c.function.arguments) for c in calls]


def test_qwen3_coder_reads_types_from_tool_dicts_too():
    """An offline LLM.chat caller sets the parser's tools from its OpenAI tool dicts."""
    parser = Qwen3CoderToolParser()
    parser.tools = TOOLS
    _, (call,) = parser.extract("<function=get_weather>\n<parameter=days>\n3\n</parameter>\n"
                                "</function>")
    assert json.loads(call.function.arguments) == {"days": 3}


NOT_CALLS = [
    (PythonicToolParser, "Sure, here it is."), (PythonicToolParser, "[Note] no calls"),
    (PythonicToolParser, "[1, 2, 3]"), (PythonicToolParser, "[]"),
    (PythonicToolParser, "[f(a=1)] and then text"), (PythonicToolParser, "[f(1)]"),
    (PythonicToolParser, "[f(a=1), g(b=x)]"), (PythonicToolParser, "[f(a=1),]"),
    (PythonicToolParser, "[f(a=print('hi'))]"), (PythonicToolParser, "[f(a=1)"),
    (PythonicToolParser, "[os.system(c='ls')]"), (PythonicToolParser, "[f(**{'a': 1})]"),
    (PythonicToolParser, "[f(a=1e999)]"), (PythonicToolParser, "[f(a={1, 2})]"),
    (PythonicToolParser, "[f(a=b'x')]"), (PythonicToolParser, "[f(a='x' # c\n)]"),
    (PythonicToolParser, "text [f(a=1)]"), (PythonicToolParser, "[f(a=1)(b=2)]"),
    (MistralToolParser, "no marker [{\"name\": \"f\", \"arguments\": {}}]"),
    (MistralToolParser, "[TOOL_CALLS] not json"), (MistralToolParser, "[TOOL_CALLS]"),
    (MistralToolParser, '[TOOL_CALLS][{"name": "f", "arguments": {"a": }}]'),
    (GraniteToolParser, "Sure."), (GraniteToolParser, "<tool_call> no list"),
    (GraniteToolParser, '[{"name": "f", "arguments": {}}] and text'),
    (GraniteToolParser, '[{"name": "f", "arguments": {}}, {"name": "g"}]'),
    (GraniteToolParser, '[{"name": "f", "arguments": {}}'), (GraniteToolParser, "[]"),
    (GraniteToolParser, '{"name": "f", "arguments": {}}'),
    (InternLMToolParser, "no call <|action_start|> here"),
    (InternLMToolParser, "<|action_start|><|plugin|>\nnot json<|action_end|>"),
    (InternLMToolParser, '<|action_start|><|plugin|>{"name": "f"} junk<|action_end|>'),
    (InternLMToolParser, '<|action_start|><|plugin|>{"name": "f", "parameters": {'),
    (Qwen3CoderToolParser, "plain <b>text</b> with <function words"),
    (Qwen3CoderToolParser, "<tool_call>\n</tool_call>"),
    (Qwen3CoderToolParser, "<tool_call>\n<function=f\n<parameter=a>1</parameter>"),
    (Qwen3CoderToolParser, "<function=f>\n<parameter=a\n1\n</parameter>\n</function>"),
]


@pytest.mark.parametrize("make, text", NOT_CALLS)
def test_answers_that_are_no_calls_stay_content(make, text):
    assert make().extract(text) == (text, [])
    content, calls = streamed(make(), text, random.Random(0))
    assert (content, calls) == (text, [])


AUTO_ANSWERS = [
    (PythonicToolParser, PYTHONIC), (PythonicToolParser, "  [f(a='[(')] \n"),
    (PythonicToolParser, "[f(a=1), g(b=x)]"), (PythonicToolParser, "[Note] x"),
    (PythonicToolParser, "[f(s='''a''b''')]"),
    (MistralToolParser, MISTRAL), (MistralToolParser, "[TOOL_CALLS] x"),
    (MistralToolParser, '[TOOL_CALLS][{"name": "f", "parameters": {"a": [1]}}]'),
    (MistralToolParser, 'a [TOOL_CALLS][{"name": "f", "arguments": {}}, {oops}]'),
    (GraniteToolParser, GRANITE), (GraniteToolParser, "<tool_call>[{oops}]"),
    (GraniteToolParser, '<|tool_call|>[{"name": "f", "arguments": {"a": 1}}]x'),
    (InternLMToolParser, INTERNLM),
    (InternLMToolParser, 'a<|action_start|><|plugin|>{"name": "f", "arguments": {}} '),
    (InternLMToolParser, '<|action_start|><|plugin|>{"name": "f"}<|action_e'),
    (qwen3_coder, QWEN3_CODER), (Qwen3CoderToolParser, "a <tool_call> b"),
    (Qwen3CoderToolParser, "<function=f>\n<parameter=a>\n1\n</function>\n<function=g\n"),
]


@pytest.mark.parametrize("make, text", AUTO_ANSWERS)
def test_every_cut_of_an_auto_answer_streams_what_it_holds_whole(make, text):
    """Wherever max_tokens ends the answer, the stream sent exactly the whole answer's content
    and calls (text held back as a possible call goes out as content once it is none)."""
    for end in range(len(text) + 1):
        answer = text[:end]
        content, calls = make().extract(answer)
        s_content, s_calls = streamed(make(), answer, random.Random(end))
        assert (s_content or None) == content, answer
        assert [(c["name"], c["arguments"]) for c in s_calls] == \
            [(c.function.name, c.function.arguments) for c in calls], answer


def test_held_back_markers_are_released_as_content():
    stream = ToolCallStream(MistralToolParser())
    assert stream.feed("Hi [TOOL") == ("Hi ", [])
    assert stream.feed("S] x") == ("[TOOLS] x", [])
    stream = ToolCallStream(Qwen3CoderToolParser())
    assert stream.feed("a <func") == ("a ", [])
    assert stream.feed("tion> b") == ("<function> b", [])
    stream = ToolCallStream(PythonicToolParser())
    assert stream.feed("[Not") == ("", [])
    assert stream.feed("e] x") == ("[Note] x", [])


CODE = "def f(x):\n    return {'a': [x, \"q\\\\\"]}  # </function>\n" * 1000


@pytest.mark.parametrize("make, text", [
    (PythonicToolParser, f"[write(path='a.py', content={CODE!r})]"),
    (Qwen3CoderToolParser, "<tool_call>\n<function=write>\n<parameter=content>\n" + CODE +
     "\n</parameter>\n</function>\n</tool_call>"),
    (GraniteToolParser, json.dumps([{"name": "write", "arguments": {"content": CODE}}])),
    (MistralToolParser, "[TOOL_CALLS]" + json.dumps([{"name": "write",
                                                      "arguments": {"content": CODE}}])),
    (InternLMToolParser, "<|action_start|><|plugin|>" + json.dumps(
        {"name": "write", "parameters": {"content": CODE}}) + "<|action_end|>"),
])
def test_a_long_call_streams_in_time(make, text):
    """50K characters of code in one argument, 4 at a time: each delta resumes the scan where
    the last stopped (a </function> in qwen3_coder's value, 1000 times, took 55 s before)."""
    _, (call,) = make().extract(text)
    assert json.loads(call.function.arguments)["content"] == CODE
    _, (s_call,) = streamed(make(), text, step=4)
    assert s_call["arguments"] == call.function.arguments


def test_mistral_and_internlm_keep_special_tokens_under_auto():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    assert plan_tools(req, "mistral", True).parser.keeps_special_tokens
    assert plan_tools(req, "internlm", True).parser.keeps_special_tokens
    assert not plan_tools(req, "hermes", True).parser.keeps_special_tokens


def test_registry_and_cli_list_the_new_parsers(capsys):
    import argparse

    from kiln.entrypoints.cli.serve import (
        TOOL_CALL_PARSER_NAMES,
        add_server_args,
        settings_from_args,
    )

    names = ("pythonic", "mistral", "qwen3_coder", "granite", "internlm")
    assert all(name in TOOL_PARSERS and name in TOOL_CALL_PARSER_NAMES for name in names)
    parser = add_server_args(argparse.ArgumentParser())
    with pytest.raises(ValueError, match="--tool-call-parser") as e:
        settings_from_args(parser.parse_args(["--enable-auto-tool-choice"]))
    assert all(name in str(e.value) for name in names)
    with pytest.raises(SystemExit):
        parser.parse_args(["--tool-call-parser", "nope"])
    err = capsys.readouterr().err
    assert all(name in err for name in names), err


def test_mistral_v11_calls_and_what_is_none():
    """v11's `[TOOL_CALLS]name{...}`: one call; a name cut before its arguments, a name with
    spaces (prose) or arguments that are no object stay content, as a first call that is no
    call does in the list format."""
    parse = MistralToolParser().extract
    content, calls = parse('[TOOL_CALLS]get_time{"zone": "UTC"}')
    assert content is None and [(c.function.name, c.function.arguments) for c in calls] == \
        [("get_time", '{"zone": "UTC"}')]
    for text in ("Hi[TOOL_CALLS]get_time", "[TOOL_CALLS]I think so {}", "[TOOL_CALLS]f[1]",
                 "[TOOL_CALLS]f[ARGS]7", '[TOOL_CALLS]f{"a": '):
        assert parse(text) == (text, []), text
