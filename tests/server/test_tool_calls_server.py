"""End to end, tool calls at their edges through the official `openai` client against a live
`kiln serve` (the tiny random Qwen2 of test_structured_server): stop strings, ignore_eos,
pydantic-style schemas, and tools OpenAI refuses. Streamed and whole answers must agree. And
/v1/responses' function tools: the same greedy call as chat's, whole and streamed as OpenAI's
events; a call's output sent back (as items, or by previous_response_id) answers as chat's tool
message does."""
import json

import pytest

from .test_server_e2e import NAME
from .test_structured_server import (
    MESSAGES,
    TIME,
    WEATHER,
    _reassemble,
)

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
def client(hermes_client):
    """The hermes server with the responses store on (conftest.py), shared with
    test_structured_server."""
    return hermes_client


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


# /v1/responses: function tools and the store (KILN_ENABLE_RESPONSES_API_STORE=1 above), with
# the openai client's responses.create / stream / previous_response_id, against chat's answers.
def flat(tool: dict) -> dict:
    """A chat tool in the Responses API's flat shape."""
    return {"type": "function", **tool["function"]}


def calls_of(output) -> list[tuple[str, str]]:
    return [(o.name, o.arguments) for o in output if o.type == "function_call"]


@pytest.mark.parametrize("choice", ["required", "get_time"])
def test_responses_forced_call_is_chats_whole_and_streamed(client, choice):
    chat_choice = choice if choice == "required" else {"type": "function",
                                                       "function": {"name": choice}}
    resp_choice = choice if choice == "required" else {"type": "function", "name": choice}
    chat = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=[WEATHER, TIME],
                                          tool_choice=chat_choice, temperature=0,
                                          max_completion_tokens=80, parallel_tool_calls=False)
    kw = dict(model=NAME, input=MESSAGES, tools=[flat(WEATHER), flat(TIME)],
              tool_choice=resp_choice, temperature=0, max_output_tokens=80,
              parallel_tool_calls=False)
    resp = client.responses.create(**kw)
    expected = [(c.function.name, c.function.arguments)
                for c in chat.choices[0].message.tool_calls]
    assert expected and calls_of(resp.output) == expected
    assert [o.type for o in resp.output] == ["function_call"]
    call = resp.output[0]
    assert call.id.startswith("fc_") and call.call_id and call.status == "completed"
    assert resp.status == "completed" and resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.tools[0].name == "get_weather" and resp.store
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    added = events[types.index("response.output_item.added")]
    assert added.item.type == "function_call" and added.item.status == "in_progress"
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == call.arguments and done.item_id == added.item.id
    (item_done,) = [e for e in events if e.type == "response.output_item.done"]
    assert item_done.item.arguments == call.arguments and item_done.item.status == "completed"
    assert types[-1] == "response.completed"
    assert calls_of(events[-1].response.output) == expected


def test_responses_call_output_sent_back_is_chats_tool_message(client):
    """The call's output sent back (by previous_response_id, or the items themselves) renders
    as chat's assistant tool call and tool message: the same prompt and greedy answer."""
    tools = [flat(WEATHER)]
    first = client.responses.create(model=NAME, input=MESSAGES, tools=tools,
                                    tool_choice="required", temperature=0,
                                    max_output_tokens=60, parallel_tool_calls=False)
    (call,) = first.output
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}
    kw = dict(model=NAME, tools=tools, tool_choice="none", temperature=0, max_output_tokens=12)
    chained = client.responses.create(previous_response_id=first.id, input=[result], **kw)
    assert chained.previous_response_id == first.id
    sent = client.responses.create(input=[*MESSAGES, call.model_dump(exclude_none=True), result],
                                   store=False, **kw)
    chat = client.chat.completions.create(
        model=NAME, messages=[*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21C"}],
        tools=[WEATHER], tool_choice="none", temperature=0, max_completion_tokens=12)
    assert chained.output_text == sent.output_text == chat.choices[0].message.content
    assert chained.usage.input_tokens == sent.usage.input_tokens == chat.usage.prompt_tokens
    # not kept (store false): 404 naming it; a deleted response is gone
    with pytest.raises(openai.NotFoundError, match=sent.id):
        client.responses.retrieve(sent.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(previous_response_id=first.id, input="hi", **kw)
    assert e.value.body["param"] == "previous_response_id" and first.id in str(e.value)


def test_responses_tools_none_are_in_the_prompt_as_chats(client):
    kw = dict(temperature=0, max_output_tokens=4)
    resp = client.responses.create(model=NAME, input=MESSAGES, tools=[flat(WEATHER)],
                                   tool_choice="none", **kw)
    bare = client.responses.create(model=NAME, input=MESSAGES, **kw)
    chat = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=[WEATHER],
                                          tool_choice="none", temperature=0,
                                          max_completion_tokens=4)
    assert resp.usage.input_tokens == chat.usage.prompt_tokens > bare.usage.input_tokens
    assert resp.output_text == chat.choices[0].message.content
    assert json.loads(json.dumps(resp.tools[0].parameters)) == WEATHER["function"]["parameters"]
