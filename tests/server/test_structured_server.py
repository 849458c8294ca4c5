"""End to end: structured outputs, tool calls and reasoning through the official `openai`
client against a live `kiln serve` on a tiny random Qwen2 with a Qwen-style chat template.

A random model follows no format by itself: every assertion rests on what the grammar forces
(schemas, regexes, forced tool_choice), so the outputs are checked, not hoped for.
"""
import concurrent.futures
import json
import os
import random
import re

import pytest

from .test_server_e2e import KEY, NAME, running_server
from checkpoints import make_tiny_checkpoint

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def tiny_qwen_chat(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen_chat"), "qwen2", tie=True,
                                tokenizer="chat", max_position_embeddings=2048)


def _serve(model, tmp_path_factory, *flags, env: dict | None = None):
    env = dict(os.environ, KILN_API_KEY=KEY, KILN_LOGGING_LEVEL="WARNING", **(env or {}))
    args = ["--enforce-eager", "--max-model-len", "2048", "--max-num-seqs", "64",
            "--kv-cache-memory", "0.05", "--disable-access-log", "--uvicorn-log-level",
            "warning", "--structured-outputs-config", '{"disable_any_whitespace": true}',
            *flags]
    return running_server(model, args, tmp_path_factory.mktemp("log") / "serve.log", env)


@pytest.fixture(scope="module")
def client(hermes_client):
    """The hermes server (conftest.py), shared with test_tool_calls_server."""
    return hermes_client


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema whose every instance is short: patterned strings, bounded integers and
    arrays,
    enums, booleans, nested objects; a random subset of its properties required."""
    props = {}
    for i in range(rng.randint(1, 3)):
        kind = rng.choice(["string", "integer", "boolean", "enum", "array"]
                          + (["object"] if depth < 2 else []))
        if kind == "string":
            # A pattern, not maxLength: xgrammar's length-bounded strings admit raw control
            # characters, which strict JSON refuses.
            p = {"type": "string", "pattern": f"^[a-z ]{{0,{rng.randint(1, 5)}}}$"}
        elif kind == "integer":
            lo = rng.randint(-50, 50)
            p = {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
        elif kind == "boolean":
            p = {"type": "boolean"}
        elif kind == "enum":
            p = {"type": "string", "enum": rng.sample(["red", "green", "blue", "x y", 'q"t'],
                                                     rng.randint(1, 3))}
        elif kind == "array":
            p = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                 "maxItems": rng.randint(1, 3)}
        else:
            p = random_schema(rng, depth + 1)
        props[f"{kind[:3]}_{i}"] = p
    required = [k for k in props if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required}


def _stream_text(stream) -> tuple[str, str | None]:
    text, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


def _one_schema_request(client, i: int) -> None:
    rng = random.Random(i)
    schema = random_schema(rng)
    sampled, stream = i % 2 == 1, i % 4 >= 2
    kw = dict(model=NAME, messages=[{"role": "user", "content": f"json {i}"}], max_tokens=200,
              temperature=1.0 if sampled else 0.0, seed=i if sampled else None,
              extra_body={"structured_outputs": {"json": schema,
                                                 "disable_any_whitespace": True}})
    if stream:
        text, finish = _stream_text(client.chat.completions.create(stream=True, **kw))
    else:
        r = client.chat.completions.create(**kw)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert finish == "stop", (i, schema, text)
    jsonschema.validate(json.loads(text), schema)


def test_hundred_json_schemas_validate(client):
    """Greedy and sampled, streamed and not, concurrently: each output is JSON its schema
    accepts, and ends by the grammar (stop), not by max_tokens."""
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: _one_schema_request(client, i), range(100)))


def test_response_format_json_schema_and_object(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=200, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": schema}})
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    # Any object: its keys are free strings, which a random model may spin out to the limit;
    # what the grammar guarantees is an object's opening, and a dict when it closes.
    r = client.completions.create(model=NAME, prompt="json:", max_tokens=40, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    text = r.choices[0].text
    assert text.startswith("{"), text
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_regex_choice_grammar_on_both_endpoints(client):
    pattern = r"[a-c]{2}-[0-9]{1,2}"
    for temperature in (0.0, 1.0):
        r = client.completions.create(model=NAME, prompt="code:", max_tokens=20, n=3,
                                      temperature=temperature,
                                      extra_body={"structured_outputs": {"regex": pattern}})
        assert all(re.fullmatch(pattern, c.text) and c.finish_reason == "stop"
                   for c in r.choices), [c.text for c in r.choices]
        choices = ["yes", "no", "not sure"]
        r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=20, n=2,
                                           temperature=temperature,
                                           extra_body={"guided_choice": choices})
        assert all(c.message.content in choices for c in r.choices)
    r = client.completions.create(model=NAME, prompt="g:", max_tokens=20, temperature=0,
                                  extra_body={"structured_outputs": {
                                      "grammar": 'root ::= "x" [0-3] [0-3] "y"'}})
    assert re.fullmatch(r"x[0-3]{2}y", r.choices[0].text)
    text, finish = _stream_text(client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=20, temperature=0, stream=True,
        extra_body={"structured_outputs": {"regex": pattern}}))
    assert re.fullmatch(pattern, text) and finish == "stop"


def test_structural_tags_in_each_field_vllm_takes_them(client):
    """response_format {"type": "structural_tag"} (xgrammar's format, or vLLM's legacy
    structures and triggers), structured_outputs.structural_tag and the older top-level
    structural_tag (their JSON text), streamed or not: the tag forces a tool call here."""
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
              "required": ["city"]}
    call = {"type": "tag", "begin": "<tool_call>", "end": "</tool_call>", "content": {
        "type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}}
    tag = {"type": "structural_tag", "format": call}

    def city(text: str) -> str:
        match = re.fullmatch(r"<tool_call>(.*)</tool_call>", text, re.S)
        assert match, text
        return json.loads(match.group(1))["city"]

    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=60,
                                       temperature=0, response_format=tag)
    assert r.choices[0].finish_reason == "stop" and city(r.choices[0].message.content)
    for body in ({"structured_outputs": {"structural_tag": json.dumps(tag)}},
                 {"structural_tag": json.dumps(tag)}):
        r = client.completions.create(model=NAME, prompt="call:", max_tokens=60, n=2,
                                      temperature=1.0, seed=2, extra_body=body)
        assert all(c.finish_reason == "stop" and city(c.text) for c in r.choices)
    text, finish = _stream_text(client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=60, temperature=0, stream=True,
        response_format=tag))
    assert finish == "stop" and city(text)
    # legacy: free text until a trigger, so a random model may write anything; only its
    # request is checked (the grammar: tests/structured_output/test_structural_tag.py)
    legacy = {"type": "structural_tag", "triggers": ["<tool_call>"], "structures": [
        {"begin": "<tool_call>", "schema": schema, "end": "</tool_call>"}]}
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=5,
                                       response_format=legacy)
    assert r.choices[0].message.content is not None


def test_cut_by_max_tokens_says_length(client):
    r = client.completions.create(model=NAME, prompt="j", max_tokens=2, temperature=0,
                                  extra_body={"structured_outputs": {"regex": "[a-z]{30}"}})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2


@pytest.mark.parametrize("body, param", [
    ({"structured_outputs": {"json": {"type": "objectx"}}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    # The server's to set from --reasoning-parser: a marker never written left it unconstrained.
    ({"structured_outputs": {"choice": ["a"], "reasoning_end": "x"}}, "structured_outputs"),
    ({"guided_json": "{not json"}, "guided_json"),
    # A keyword the grammar would not enforce; nesting that overflowed the request's copy (500).
    ({"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}},
     "structured_outputs"),
    ({"guided_json": json.dumps({"type": "array", "items": {"type": "array", "items": {}}})
      .replace('{}', '{"type": "array", "items": ' * 500 + '{}' + '}' * 500)}, "guided_json"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    # structural tags: none, both forms at once, a keyword the grammar would not enforce
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "any_text"},
                          "triggers": ["<f"]}}, "response_format"),
    ({"structural_tag": json.dumps({"type": "structural_tag", "format": {
        "type": "json_schema", "json_schema": {"type": "array", "uniqueItems": True}}})},
     "structural_tag"),
    ({"structured_outputs": {"structural_tag": '{"format": 1}'}}, "structured_outputs"),
])
def test_bad_constraint_is_400_naming_it(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=5,
                                       extra_body=body)
    assert e.value.body["param"] == param, e.value.body
    # The server is unharmed: the next request runs.
    assert client.completions.create(model=NAME, prompt="a", max_tokens=2).choices


def test_a_grammar_with_no_way_on_fails_with_its_reason(client):
    """The grammar allows "ab" and then nothing: the engine ends the request, and the client
    is told why (a 400, or an error event once the stream has begun), not a 200 "abort"."""
    dead = {"structured_outputs": {"regex": "ab[^\\s\\S]"}}
    want = "structured_outputs.regex allows no token after 2 generated token(s)"
    for n in (1, 2):
        with pytest.raises(openai.BadRequestError, match=re.escape(want)) as e:
            client.completions.create(model=NAME, prompt="x", max_tokens=8, n=n,
                                      extra_body=dead)
        assert e.value.body["code"] == "request_failed"
    with pytest.raises(openai.BadRequestError, match=re.escape(want)):
        client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=8,
                                       extra_body=dead)
    for stream in (client.completions.create(model=NAME, prompt="x", max_tokens=8, stream=True,
                                             extra_body=dead),
                   client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=8,
                                                  stream=True, extra_body=dead)):
        with pytest.raises(openai.APIError, match=re.escape(want)):
            for _ in stream:
                pass
    assert client.completions.create(model=NAME, prompt="a", max_tokens=2).choices


NEVER = {"type": "string", "pattern": "^a[^\\s\\S]$"}  # "a", then no character at all


@pytest.mark.parametrize("body,param,text", [
    ({"guided_regex": "ab[^\\s\\S]"}, "guided_regex", "guided_regex: structured_outputs.regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": NEVER}}},
     "response_format", "response_format: structured_outputs.json"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": NEVER}, "required": ["a"]}}}],
      "tool_choice": "required"}, "tools", "tools: the schema of the tools' parameters"),
])
def test_a_dead_grammar_names_the_field_the_client_sent(client, body, param, text):
    """The core knows every constraint as structured_outputs.X: its failure is told in terms
    of the field the client sent (param too), whole and streamed."""
    with pytest.raises(openai.BadRequestError, match=re.escape(text)) as e:
        client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=60,
                                       extra_body=body)
    assert (e.value.body["param"], e.value.body["code"]) == (param, "request_failed")
    stream = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=60,
                                            stream=True, extra_body=body)
    with pytest.raises(openai.APIError, match=re.escape(text)):
        for _ in stream:
            pass


def _reassemble(stream) -> tuple[dict[int, dict], str | None, str]:
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = d.id or call["id"]
                if d.function is not None:
                    call["name"] = d.function.name or call["name"]
                    call["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return calls, finish, content


def test_named_tool_choice(client):
    kw = dict(model=NAME, messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=100,
              temperature=0, tool_choice={"type": "function",
                                          "function": {"name": "get_weather"}})
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.tool_calls, r.choices[0]
    (call,) = r.choices[0].message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    calls, finish, _ = _reassemble(client.chat.completions.create(stream=True, **kw))
    assert [c["name"] for c in calls.values()] == ["get_weather"] and calls[0]["id"]
    assert json.loads(calls[0]["arguments"]) == args and finish == "stop"
    # cut short by max_tokens: still the call, its arguments the text so far, streamed or not
    kw["max_tokens"] = 3
    r = client.chat.completions.create(**kw)
    (call,) = r.choices[0].message.tool_calls
    calls, finish, content = _reassemble(client.chat.completions.create(stream=True, **kw))
    assert r.choices[0].finish_reason == finish == "length" and not content
    assert call.function.arguments == calls[0]["arguments"] != ""


def test_required_tool_choice(client):
    kw = dict(model=NAME, messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=200,
              temperature=0, tool_choice="required",
              extra_body={"structured_outputs": None})
    r = client.chat.completions.create(**kw)
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason == "tool_calls"
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name])
    streamed, finish, _ = _reassemble(client.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in calls]
    # the SDK's own accumulator copies each delta's keys over what it gathered: a later
    # piece must leave out id, type and name, not send them as null
    with client.chat.completions.stream(**kw) as events:
        final = events.get_final_completion()
    assert [(c.type, c.function.name, json.loads(c.function.arguments))
            for c in final.choices[0].message.tool_calls] == \
        [("function", c.function.name, json.loads(c.function.arguments)) for c in calls]
    for seed in range(3):  # parallel_tool_calls=false: the grammar allows one call only
        r = client.chat.completions.create(**{**kw, "temperature": 1.0}, seed=seed,
                                           parallel_tool_calls=False)
        assert len(r.choices[0].message.tool_calls) == 1


def test_auto_tool_choice_reads_hermes_calls(client):
    """tool_choice auto with the hermes parser; a regex makes the random model write a Qwen
    tool call, which comes back as tool_calls (streamed: as deltas that reassemble)."""
    pattern = ('<tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": '
               '"(Paris|Rome)", "days": [1-7]\\}\\}\\n</tool_call>')
    kw = dict(model=NAME, messages=MESSAGES, tools=[WEATHER], max_tokens=120, temperature=0,
              extra_body={"structured_outputs": {"regex": pattern}})
    r = client.chat.completions.create(**kw)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Rome") and r.choices[0].message.content is None
    calls, finish, content = _reassemble(client.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls" and content == ""
    assert json.loads(calls[0]["arguments"]) == args and calls[0]["name"] == "get_weather"
    # tool_choice none: the same text is content, no tool calls.
    r = client.chat.completions.create(tool_choice="none", **kw)
    assert not r.choices[0].message.tool_calls and "<tool_call>" in r.choices[0].message.content


def test_tokenize_renders_the_tools_as_chat_does(client):
    """/tokenize with messages and tools counts what a chat request's prompt_tokens count."""
    import httpx

    r = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=[WEATHER],
                                       tool_choice="none", max_tokens=1)
    base = str(client.base_url).removesuffix("/v1/")
    headers = {"Authorization": f"Bearer {KEY}"}
    counts = [httpx.post(f"{base}/tokenize", headers=headers, json={
        "model": NAME, "messages": MESSAGES, **extra}).json()["count"]
        for extra in ({"tools": [WEATHER]}, {})]
    assert counts[0] == r.usage.prompt_tokens > counts[1]


def test_tool_history_renders(client):
    """An assistant turn with tool_calls and a tool result go through the template."""
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER],
                                       tool_choice="none", max_tokens=3)
    assert r.choices[0].message.content is not None
