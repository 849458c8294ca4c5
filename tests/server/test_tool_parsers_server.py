"""End to end, the pythonic, mistral, qwen3_coder, granite and internlm parsers through
/v1/chat/completions of the server app (`--tool-call-parser NAME --enable-auto-tool-choice`) on
the tiny random Qwen2 of test_structured_server, in process (three `kiln serve` start-ups took
100 s on 2 shared cores): a regex forces the model to write each format's calls after some
content; whole and streamed answers agree, with finish_reason "tool_calls"."""
import json
import re

import pytest
from fastapi.testclient import TestClient

from kiln.engine.arg_utils import EngineArgs
from kiln.engine.async_llm import AsyncLLM
from kiln.engine.llm_engine import LLMEngine
from kiln.entrypoints.openai.api_server import ServerSettings, build_app

from .fake_api import sse_events
from .fake_engine import RecordingEngine, TextWritingEngine
from .test_structured_server import MESSAGES, WEATHER, tiny_qwen_chat

# name -> (the answer the regex forces, its content, its calls)
ANSWERS = {
    "granite": ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}]',
                None, [("get_weather", {"city": "Rome", "days": 2})]),
    "internlm": ('Ok.<|action_start|><|plugin|>\n{"name": "get_weather", "parameters": '
                 '{"city": "Rome", "days": 2}}<|action_end|>', "Ok.",
                 [("get_weather", {"city": "Rome", "days": 2})]),
    "pythonic": ("[get_weather(city='Rome', days=2), get_time(zone=\"UTC\")]", None,
                 [("get_weather", {"city": "Rome", "days": 2}), ("get_time", {"zone": "UTC"})]),
    "mistral": ('Ok.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", '
                '"days": 2}}, {"name": "get_time", "arguments": {"zone": "UTC"}}]', "Ok.",
                [("get_weather", {"city": "Rome", "days": 2}), ("get_time", {"zone": "UTC"})]),
    "qwen3_coder": ("Ok.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n"
                    "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
                    "Ok.\n", [("get_weather", {"city": "Rome", "days": 2})]),
}


def _regex(text: str) -> str:
    """`text` as a regex matching only itself (newlines as \\n, for the grammar's dialect)."""
    return "".join("\\n" if c == "\n" else "\\" + c if c in r".^$*+?{}[]\|()" else c
                   for c in text)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_qwen_chat(tmp_path_factory)


def _reassemble(events) -> tuple[list, str | None, str]:
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for event in events:
        for c in event["choices"]:
            content += c["delta"].get("content") or ""
            for d in c["delta"].get("tool_calls") or []:
                call = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
                call["id"] = d.get("id") or call["id"]
                call["name"] = d["function"].get("name") or call["name"]
                call["arguments"] += d["function"].get("arguments") or ""
            finish = c["finish_reason"] or finish
    return [calls[k] for k in sorted(calls)], finish, content


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_a_forced_answer_reads_as_vllm_parser_reads_it(name, model, inprocess_core):
    text, content, expected = ANSWERS[name]
    args = EngineArgs(model=str(model), enforce_eager=True, max_model_len=1024, block_size=16)
    settings = ServerSettings(tool_call_parser=name, enable_auto_tool_choice=True)
    body = dict(model=str(model), messages=MESSAGES, temperature=0, tools=[WEATHER],
                max_tokens=150, structured_outputs={"regex": _regex(text)})
    with TestClient(build_app(AsyncLLM(LLMEngine(args.create_kiln_config())), settings)) as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        calls, finish, s_content = _reassemble(
            sse_events(c, "/v1/chat/completions", {**body, "stream": True}))
    message = choice["message"]
    assert choice["finish_reason"] == finish == "tool_calls"
    assert message["content"] == (s_content or None) == content
    whole = [(t["function"]["name"], t["function"]["arguments"]) for t in message["tool_calls"]]
    assert [(n, json.loads(a)) for n, a in whole] == expected
    assert [(t["name"], t["arguments"]) for t in calls] == whole
    ids = [t["id"] for t in message["tool_calls"]] + [t["id"] for t in calls]
    if name == "mistral":  # mistral_common's id format
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)
    assert all(ids)


@pytest.mark.parametrize("parser, tool_choice, skip", [
    ("mistral", "auto", False), ("mistral", "none", True), ("internlm", "auto", False),
    ("hermes", "auto", True)])
def test_special_call_markers_are_decoded_under_auto(parser, tool_choice, skip):
    """mistral's [TOOL_CALLS] and internlm's <|action_start|> are special tokens: skipped, no
    call could ever be read (vLLM's adjust_request keeps special tokens where tools may be
    called)."""
    engine = RecordingEngine(max_model_len=64)
    settings = ServerSettings(tool_call_parser=parser, enable_auto_tool_choice=True)
    with TestClient(build_app(AsyncLLM(engine), settings)) as c:
        r = c.post("/v1/chat/completions", json=dict(
            model="fake-model", messages=[{"role": "user", "content": "x"}], max_tokens=2,
            tools=[WEATHER], tool_choice=tool_choice))
    assert r.status_code == 200, r.text
    assert engine.params.skip_special_tokens is skip


DEEP = "[" * 5000 + "]" * 5000  # past json.loads's recursion limit


@pytest.mark.parametrize("parser, text", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": ' + DEEP + "}}</tool_call>"),
    ("llama3_json", '{"name": "f", "parameters": {"a": ' + DEEP + "}}"),
    ("granite", '[{"name": "f", "arguments": {"a": ' + DEEP + "}}]"),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": ' + DEEP + "}}]")])
@pytest.mark.parametrize("stream", [False, True])
def test_a_call_nested_past_the_json_reader_limit_is_content(parser, text, stream):
    """A model that wrote "[" thousands of times: no call, its text content (was HTTP 500, or
    an error event in the stream, from json.loads's RecursionError)."""
    settings = ServerSettings(tool_call_parser=parser, enable_auto_tool_choice=True)
    body = dict(model="fake-model", messages=[{"role": "user", "content": "x"}], max_tokens=1,
                tools=[WEATHER])
    with TestClient(build_app(AsyncLLM(TextWritingEngine(text)), settings)) as c:
        if stream:
            events = sse_events(c, "/v1/chat/completions", {**body, "stream": True})
            assert "".join(ch["delta"].get("content") or "" for e in events
                           for ch in e.get("choices", ())) == text
            assert not any("error" in e for e in events)
            return
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["content"] == text and not message.get("tool_calls")
