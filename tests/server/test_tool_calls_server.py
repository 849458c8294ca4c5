"""End to end, tool calls at their edges through the official `openai` client against a live
`kiln serve` (the tiny random Qwen2 of test_structured_server): stop strings, ignore_eos,
pydantic-style schemas, and tools OpenAI refuses. Streamed and whole answers must agree."""
import json

import pytest

from .test_server_e2e import KEY, NAME
from .test_structured_server import MESSAGES, WEATHER, _reassemble, _serve, tiny_qwen_chat

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

# pydantic's model_json_schema() for a model with a nested one (what the OpenAI SDK sends).
BOOK = {"type": "function", "function": {"name": "book", "parameters": {
    "$defs": {"City": {"type": "object", "properties": {
        "name": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["name"],
        "additionalProperties": False}},
    "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with _serve(tiny_qwen_chat(tmp_path_factory), tmp_path_factory, "--tool-call-parser",
                "hermes", "--enable-auto-tool-choice") as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


def both(client, **kw):
    """(the whole answer's choice, the stream's (calls, finish_reason, content))."""
    kw = dict(model=NAME, messages=MESSAGES, temperature=0, **kw)
    return (client.chat.completions.create(**kw).choices[0],
            _reassemble(client.chat.completions.create(stream=True, **kw)))


def test_a_stop_string_that_cuts_a_required_call_finishes_stop(client):
    """The grammar writes {"city": ... first; the stop string cuts there: arguments short of
    JSON are no finished tool call, so finish_reason stays "stop", streamed or not."""
    choice, (calls, finish, _) = both(client, tools=[WEATHER], tool_choice="required",
                                      max_tokens=40, stop=["city"])
    assert choice.finish_reason == finish == "stop" and choice.stop_reason == "city"
    assert [c.function.arguments for c in choice.message.tool_calls] == \
        [c["arguments"] for c in calls.values()] == ['{"']


def test_a_stop_string_after_an_auto_call_finishes_tool_calls(client):
    """Under "auto" the calls read are whole JSON ones, whatever ended the text: a client
    that stops at "</tool_call>" still gets "tool_calls", as from vLLM."""
    pattern = ('<tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": "Rome", '
               '"days": 2\\}\\}\\n</tool_call>')
    choice, (calls, finish, _) = both(client, tools=[WEATHER], max_tokens=120,
                                      stop=["</tool_call>"],
                                      extra_body={"structured_outputs": {"regex": pattern}})
    assert choice.finish_reason == finish == "tool_calls"
    assert choice.stop_reason == "</tool_call>"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
        [("get_weather", '{"city": "Rome", "days": 2}')]


def test_a_named_call_under_ignore_eos_is_its_arguments_only(client):
    """The grammar ends with the arguments; ignore_eos writes on unconstrained after them."""
    choice, (calls, _, content) = both(client, tools=[WEATHER], max_tokens=40,
                                       extra_body={"ignore_eos": True}, tool_choice={
                                           "type": "function",
                                           "function": {"name": "get_weather"}})
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert [c["arguments"] for c in calls.values()] == [call.function.arguments]
    assert not content and not choice.message.content


def test_required_with_pydantic_defs_compiles_and_validates(client):
    choice, (calls, finish, _) = both(client, tools=[BOOK, WEATHER], tool_choice="required",
                                      max_tokens=100, parallel_tool_calls=False)
    assert choice.finish_reason == finish == "tool_calls"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (BOOK, WEATHER)}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


@pytest.mark.parametrize("function, message", [
    ({"name": "", "parameters": {"type": "object"}}, "name is empty"),
    ({"name": "f", "parameters": {"type": "integer"}}, 'of type "object"'),
])
@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_tools_openai_refuses_are_400s(client, function, message, tool_choice):
    with pytest.raises(openai.BadRequestError, match=message) as e:
        client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2,
                                       tools=[{"type": "function", "function": function}],
                                       tool_choice=tool_choice)
    assert e.value.body["param"] == "tools"
