"""The HTTP layer against a fake engine (no model): shapes, SSE, errors, auth, limits, metrics."""
import gc
import json
import threading

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai import serving_tokenization
from kiln.entrypoints.openai.api_server import ServerSettings, build_app
from kiln.entrypoints.openai.errors import _loc_to_param, in_api_terms, param_from_message
from kiln.entrypoints.openai.response_models import TokenizeResponse

from .fake_engine import FakeEngine

MODEL = "fake-model"


@pytest.fixture(scope="module")
def client():
    llm = AsyncLLM(FakeEngine(max_model_len=64))
    app = build_app(llm, ServerSettings(max_request_body_bytes=2000))
    with TestClient(app) as c:
        yield c


def sse_events(client, path, body, headers=None):
    with client.stream("POST", path, json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def assert_error(r, status, param, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def test_health_models_version(client):
    assert client.get("/health").status_code == 200
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert client.get("/version").json()["version"]


def test_completion_whole_and_streamed_agree(client):
    body = dict(model=MODEL, prompt="hello", max_tokens=5, temperature=0)
    whole = client.post("/v1/completions", json=body).json()
    assert whole["object"] == "text_completion"
    (choice,) = whole["choices"]
    assert choice["finish_reason"] == "length" and len(choice["text"].split()) == 5
    assert whole["usage"] == {"prompt_tokens": 6, "completion_tokens": 5, "total_tokens": 11}
    events = sse_events(client, "/v1/completions",
                        {**body, "stream": True, "stream_options": {"include_usage": True}})
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == choice["text"]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", dict(prompt="hello")),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hello"}])),
])
def test_continuous_usage_stats_on_every_chunk(client, path, body):
    events = sse_events(client, path, {**body, "model": MODEL, "max_tokens": 4, "stream": True,
                                       "stream_options": {"include_usage": True,
                                                          "continuous_usage_stats": True}})
    chunks = [e for e in events if e["choices"] and "usage" in e and e["usage"]]
    role_chunk = [0] if "messages" in body else []  # chat's first chunk: the role, 0 tokens
    assert [c["usage"]["completion_tokens"] for c in chunks] == role_chunk + [1, 2, 3, 4]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == chunks[-1]["usage"]
    plain = sse_events(client, path, {**body, "model": MODEL, "max_tokens": 4, "stream": True,
                                      "stream_options": {"include_usage": True}})
    assert not any(e.get("usage") for e in plain[:-1])


def test_completion_n_multi_prompt_token_ids_echo(client):
    r = client.post("/v1/completions", json=dict(prompt=["ab", "cd"], n=2, max_tokens=3)).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert r["choices"][0]["text"] != r["choices"][1]["text"]  # samples differ
    r = client.post("/v1/completions", json=dict(prompt=[5, 6, 7], max_tokens=2, echo=True))
    assert r.json()["choices"][0]["text"].startswith("5 6 7 ")
    events = sse_events(client, "/v1/completions", dict(prompt=["ab", "cd"], n=2, max_tokens=3,
                                                        stream=True))
    assert {c["index"] for e in events for c in e["choices"]} == {0, 1, 2, 3}


def test_completion_stop_and_logprobs(client):
    r = client.post("/v1/completions", json=dict(prompt="hello", max_tokens=6, logprobs=2)).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    assert lp["text_offset"][1] == len(lp["tokens"][0])
    assert all(lp["tokens"][i] in lp["top_logprobs"][i] for i in range(6))
    second = r["choices"][0]["text"].split()[1]
    r = client.post("/v1/completions", json=dict(prompt="hello", max_tokens=6, stop=second))
    assert r.json()["choices"][0]["finish_reason"] == "stop"


def test_streamed_text_offsets_count_text_held_back_for_stop_strings(client):
    """With stop strings the engine sends a token's text later than its logprobs; offsets
    must still count every token's characters, as the whole response does."""
    body = dict(prompt="hello", max_tokens=6, logprobs=1, stop=["never"])
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    events = sse_events(client, "/v1/completions", {**body, "stream": True})
    offsets = [x for e in events for c in e["choices"] if c["logprobs"]
               for x in c["logprobs"]["text_offset"]]
    assert offsets == whole["logprobs"]["text_offset"]
    assert "".join(c["text"] for e in events for c in e["choices"]) == whole["text"]


def test_completion_echo_with_logprobs_covers_the_prompt(client):
    body = dict(prompt=[5, 6, 7], max_tokens=2, echo=True, logprobs=1)
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith("5 6 7 ")
    assert lp["tokens"][:3] == ["5 ", "6 ", "7 "] and len(lp["tokens"]) == 5
    # The first prompt token has nothing before it: null, as OpenAI reports it.
    assert lp["token_logprobs"][:3] == [None, -0.25, -0.25] and lp["top_logprobs"][0] is None
    assert lp["top_logprobs"][1] == {"6 ": -0.25} and lp["text_offset"][:4] == [0, 2, 4, 6]
    events = sse_events(client, "/v1/completions", {**body, "stream": True, "n": 2})
    for index in (0, 1):
        chunks = [c["logprobs"] for e in events for c in e["choices"] if c["index"] == index]
        tokens = [t for chunk in chunks for t in chunk["tokens"]]
        assert tokens[:3] == ["5 ", "6 ", "7 "] and len(tokens) == 5
        assert chunks[0]["token_logprobs"][:3] == [None, -0.25, -0.25]


def test_completion_echo_with_max_tokens_0_scores_the_prompt_only(client):
    """echo + max_tokens 0 (how evaluation harnesses score a text): the prompt back with its
    logprobs, no generated token, finish_reason length, no completion tokens counted."""
    body = dict(prompt=[5, 6, 7], max_tokens=0, echo=True, logprobs=1, return_token_ids=True)
    r = client.post("/v1/completions", json=body).json()
    choice = r["choices"][0]
    assert choice["text"] == "5 6 7 " and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["5 ", "6 ", "7 "]
    assert choice["logprobs"]["token_logprobs"] == [None, -0.25, -0.25]
    assert choice["token_ids"] == [] and choice["prompt_token_ids"] == [5, 6, 7]
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] == 3
    events = sse_events(client, "/v1/completions",
                        {**body, "n": 2, "stream": True, "stream_options": {"include_usage": True}})
    for index in (0, 1):
        chunks = [c for e in events for c in e["choices"] if c["index"] == index]
        assert "".join(c["text"] for c in chunks) == "5 6 7 "
        assert [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]] == \
            ["5 ", "6 ", "7 "]
        assert chunks[-1]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize("body,param,hint", [
    (dict(max_tokens=0), "max_tokens", "echo=true"),
    (dict(max_tokens=0, echo=False), "max_tokens", "echo=true"),
    (dict(max_tokens=0, echo=True, min_tokens=1), "min_tokens", "max_tokens=0")])
def test_completion_max_tokens_0_without_echo_is_refused_naming_the_field(client, body, param,
                                                                          hint):
    r = client.post("/v1/completions", json=dict(prompt="hi", **body))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and hint in error["message"]


def test_chat_whole_streamed_and_logprobs(client):
    body = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                logprobs=True, top_logprobs=2)
    whole = client.post("/v1/chat/completions", json=body).json()
    assert whole["object"] == "chat.completion"
    msg = whole["choices"][0]["message"]
    assert msg["role"] == "assistant" and len(msg["content"].split()) == 4
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and len(content[0]["top_logprobs"]) == 2
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    events = sse_events(client, "/v1/chat/completions", {**body, "stream": True, "n": 2})
    assert events[0]["object"] == "chat.completion.chunk"
    assert [c["delta"]["role"] for c in events[0]["choices"]] == ["assistant", "assistant"]
    text0 = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"]
                    if c["index"] == 0)
    assert text0 == msg["content"]
    # multi-part text content is accepted (an assistant's refusal part too); images are not
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    r = client.post("/v1/chat/completions", json=dict(messages=[
        {"role": "user", "content": parts},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
        {"role": "user", "content": "x"}]))
    assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", json=dict(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]))
    assert_error(r, 400, "messages[0].content[0]")


@pytest.mark.parametrize("path,body,param,code", [
    ("/v1/completions", dict(model="nope", prompt="x"), "model", "model_not_found"),
    ("/v1/completions", dict(prompt="x" * 80), "prompt", "context_length_exceeded"),
    ("/v1/completions", dict(prompt=[]), "prompt", None),
    ("/v1/completions", dict(prompt="x", temperature=-1), "temperature", "invalid_value"),
    ("/v1/completions", dict(prompt="x", top_p=5), "top_p", "invalid_value"),
    ("/v1/completions", dict(prompt="x", n=0), "n", None),
    ("/v1/completions", dict(prompt="x", max_tokens=0), "max_tokens", None),
    ("/v1/completions", dict(prompt="x", logprobs=99), "logprobs", None),
    ("/v1/completions", dict(prompt="x", presence_penalty=3), "presence_penalty", None),
    ("/v1/completions", dict(prompt="x", temperature="hot"), "temperature", None),
    ("/v1/completions", dict(prompt="x", stop=5), "stop", None),
    ("/v1/completions", dict(temperature=0.5), "prompt", "missing"),
    # vLLM's embeddings-only prompt (no prompt field): refused by name, not "missing 'prompt'"
    ("/v1/completions", dict(prompt_embeds="AAAA"), "prompt_embeds", "unsupported_parameter"),
    ("/v1/completions", dict(prompt="x", logit_bias={"five": 1}), "logit_bias", None),
    ("/v1/completions", dict(prompt="x", allowed_token_ids=[]), "allowed_token_ids", None),
    ("/v1/completions", dict(prompt="x", use_beam_search=True, stream=True), "use_beam_search",
     "unsupported_parameter"),
    ("/v1/chat/completions", dict(messages="hi"), "messages", None),
    ("/v1/chat/completions", dict(messages=[]), "messages", None),
    ("/v1/chat/completions", dict(messages=[{"content": "x"}]), "messages[0].role", "missing"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}], logprobs=True,
                                  top_logprobs=30), "top_logprobs", "invalid_value"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}],
                                  max_completion_tokens=0), "max_completion_tokens", None),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x" * 80}]),
     "messages", "context_length_exceeded"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}], model="gpt-4"),
     "model", "model_not_found"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}],
                                  chat_template_kwargs={"chat_template": "{{ 7 * 7 }}"}),
     "chat_template_kwargs", None),
    ("/detokenize", dict(tokens=[1, 10_000]), "tokens", None),
    # as OpenAI and vLLM: a max_tokens that cannot fit beside the prompt is refused, not cut
    ("/v1/completions", dict(prompt="x", max_tokens=100), "max_tokens",
     "context_length_exceeded"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}],
                                  max_completion_tokens=100), "max_completion_tokens",
     "context_length_exceeded"),
    # fields that would change the output, refused rather than ignored (helper-49)
    *[("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}], **{k: v}), k,
       "unsupported_parameter") for k, v in [
        ("functions", [{"name": "f", "parameters": {}}]), ("function_call", "auto"),
        ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
        ("structural_tag", "{}"), ("guided_whitespace_pattern", " *"),
        ("truncation_side", "right"), ("logprob_token_ids", [1]),
        ("thinking_token_budget", 10)]],
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}],
                                  max_completion_tokens=3, min_tokens=5), "min_tokens", None),
    # -1 (the whole vocabulary) past --max-logprobs names the field sent (it said "prompt")
    ("/v1/completions", dict(prompt="x", logprobs=-1), "logprobs", None),
    ("/v1/completions", dict(prompt="x", prompt_logprobs=-1), "prompt_logprobs", None),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}], logprobs=True,
                                  top_logprobs=-1), "top_logprobs", None),
    # OpenAI's cap: each choice is built in the engine at once
    ("/v1/completions", dict(prompt="x", n=129), "n", None),
    ("/v1/completions", dict(prompt=[True, False]), "prompt", None),  # no token ids
    ("/v1/completions", dict(prompt="x", seed=2 ** 64), "seed", "invalid_value"),
    ("/v1/completions", dict(prompt="x", repetition_penalty=1e-50), "repetition_penalty",
     "invalid_value"),
])
def test_bad_input_is_400_naming_the_field(client, path, body, param, code):
    # An unknown model is a 404, as OpenAI and vLLM answer it.
    status = 404 if code == "model_not_found" else 400
    err = assert_error(client.post(path, json=body), status, param, code)
    assert err["type"] == "invalid_request_error"
    if "max_completion_tokens" in body:  # its name throughout, not only first
        assert "max_tokens" not in err["message"], err
    # and the server keeps serving
    assert client.post("/v1/completions", json=dict(prompt="x", max_tokens=1)).status_code == 200


def test_null_means_the_default(client):
    """OpenAI clients send explicit nulls for fields they leave unset."""
    body = dict(prompt="hello", max_tokens=3, n=None, stream=None, presence_penalty=None,
                echo=None, min_tokens=None, ignore_eos=None, skip_special_tokens=None)
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1
    chat = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=2, logprobs=None,
                n=None, add_generation_prompt=None, frequency_penalty=None)
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert_error(client.post("/v1/completions", json=dict(prompt=None)), 400, "prompt")


def test_errors_name_the_field_the_client_sent(client):
    chat = dict(messages=[{"role": "user", "content": "x"}])
    err = assert_error(client.post("/v1/chat/completions",
                                   json={**chat, "max_completion_tokens": 0}),
                       400, "max_completion_tokens")
    assert err["message"].startswith("max_completion_tokens must be")
    err = assert_error(client.post("/v1/chat/completions",
                                   json={**chat, "logprobs": True, "top_logprobs": 21}),
                       400, "top_logprobs")
    assert err["message"].startswith("top_logprobs must be")


def test_engine_death_while_collecting_is_503():
    llm = AsyncLLM(FakeEngine(step_delay=0.01))
    with TestClient(build_app(llm, ServerSettings())) as c:
        llm.engine.fail_next_step = True
        r = c.post("/v1/completions", json=dict(prompt="x", max_tokens=5))
        assert_error(r, 503, None, "engine_dead")


def test_engine_death_while_streaming_is_the_same_error_in_band():
    """A stream's error event had code engine_error where a collected request's 503 said
    engine_dead, for the same death (a shutdown's abort, a dead core)."""
    llm = AsyncLLM(FakeEngine(step_delay=0.01))
    with TestClient(build_app(llm, ServerSettings())) as c:
        llm.engine.fail_next_step = True
        r = c.post("/v1/completions", json=dict(prompt="x", max_tokens=5, stream=True))
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        errors = [e["error"] for e in events if "error" in e]
        assert len(errors) == 1 and errors[0]["code"] == "engine_dead", r.text
        assert r.text.rstrip().endswith("data: [DONE]")


def test_a_request_after_shutdown_began_is_503_shutting_down_not_engine_dead():
    """A deliberate stop has its own code (the shutdown gate's), apart from a crash's, so a
    client can tell them apart: both were engine_dead."""
    llm = AsyncLLM(FakeEngine(step_delay=0.01))
    with TestClient(build_app(llm, ServerSettings())) as c:
        c.portal.call(llm.abort_all, "the server is shutting down")  # on the app's loop
        for stream in (False, True):
            r = c.post("/v1/completions", json=dict(prompt="x", max_tokens=5, stream=stream))
            err = assert_error(r, 503, None, "server_shutting_down")
            assert "shutting down" in err["message"]


def test_a_request_racing_the_engines_death_is_503(monkeypatch):
    """The core (or a rank) died before the watcher told the server: the request's own add
    found it, and its error was a 500."""
    from kiln.executor.rank_errors import WorkerFailedError

    llm = AsyncLLM(FakeEngine())

    def dead(*args, **kwargs):
        raise WorkerFailedError("worker rank 1 (pid 7) was killed by SIGKILL between steps")

    monkeypatch.setattr(llm.engine, "add_processed_request", dead)
    with TestClient(build_app(llm, ServerSettings())) as c:
        r = c.post("/v1/completions", json=dict(prompt="x", max_tokens=5))
        assert "worker rank 1" in assert_error(r, 503, None, "engine_dead")["message"]


def test_malformed_json_wrong_body_unknown_route(client):
    r = client.post("/v1/completions", content=b'{"prompt": "x",',
                    headers={"content-type": "application/json"})
    assert_error(r, 400, None, "json_invalid")
    # a raw control character in a string: json.loads's message without its place read
    # "request body is not valid JSON: Invalid control character at"
    r = client.post("/v1/completions", content=b'{"prompt": "a\x01"}',
                    headers={"content-type": "application/json"})
    assert assert_error(r, 400, None, "json_invalid")["message"].endswith(
        "Invalid control character at line 1 column 14 (char 13)")
    assert_error(client.post("/v1/completions", json=[1, 2]), 400, None)
    assert_error(client.get("/v1/nothing"), 404, None)
    assert_error(client.post("/v1/completions", content=b"x" * 5000,
                             headers={"content-type": "application/json"}), 413, None,
                 "request_too_large")


def test_tokenize_detokenize(client):
    r = client.post("/tokenize", json=dict(prompt="ab", return_token_strs=True)).json()
    assert r["count"] == len(r["tokens"]) == 3 and r["max_model_len"] == 64
    assert len(r["token_strs"]) == 3
    chat = client.post("/tokenize", json=dict(messages=[{"role": "user", "content": "a"}])).json()
    assert chat["count"] > 3
    assert client.post("/detokenize", json=dict(tokens=[7, 8])).json() == {"prompt": "7 8 "}
    assert_error(client.post("/tokenize", json=dict(model=MODEL)), 400, "prompt")



def threads_calling(monkeypatch, module, name: str) -> list[str]:
    """The names of the threads that call module.name from now on (the list fills)."""
    threads = []
    real = getattr(module, name)

    def spy(*args):
        threads.append(threading.current_thread().name)
        return real(*args)
    monkeypatch.setattr(module, name, spy)
    return threads


def test_tokenize_body_is_built_on_a_front_end_thread(client, monkeypatch):
    # Not on the event loop: a huge prompt's ids would hold every stream's next token.
    threads = threads_calling(monkeypatch, serving_tokenization, "tokenize_response_json")
    assert client.post("/tokenize", json=dict(prompt="ab")).json()["count"] == 3
    client.post("/tokenize", json=dict(messages=[{"role": "user", "content": "a"}]))
    assert len(threads) == 2 and all(n.startswith("kiln-frontend") for n in threads), threads


@pytest.mark.parametrize("strs", [None, ["a", "b"]])
def test_tokenize_response_json_is_the_models_dump(strs):
    expected = TokenizeResponse(tokens=[5, 6], count=2, max_model_len=64,
                                token_strs=strs).model_dump(exclude_none=True)
    assert json.loads(serving_tokenization.tokenize_response_json([5, 6], 64, strs)) == expected

def _samples(client) -> dict:
    text = client.get("/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0) + s.value
    return out


def test_metrics_parse_and_move(client):
    before = _samples(client)
    for name in ("kiln:num_requests_running", "kiln:num_requests_waiting",
                 "kiln:kv_cache_usage_perc", "kiln:prompt_tokens_total",
                 "kiln:generation_tokens_total", "kiln:time_to_first_token_seconds_count",
                 "kiln:inter_token_latency_seconds_count"):
        assert name in before, name
    client.post("/v1/completions", json=dict(prompt="abc", max_tokens=4))
    after = _samples(client)
    assert after["kiln:generation_tokens_total"] - before["kiln:generation_tokens_total"] == 4
    assert after["kiln:prompt_tokens_total"] - before["kiln:prompt_tokens_total"] == 4
    assert after["kiln:time_to_first_token_seconds_count"] == \
        before["kiln:time_to_first_token_seconds_count"] + 1
    assert after["kiln:inter_token_latency_seconds_count"] == \
        before["kiln:inter_token_latency_seconds_count"] + 3
    assert after["kiln:num_requests_running"] == 0


def test_api_key():
    llm = AsyncLLM(FakeEngine())
    with TestClient(build_app(llm, ServerSettings(api_key="sekrit"))) as c:
        body = dict(prompt="x", max_tokens=1)
        assert_error(c.post("/v1/completions", json=body), 401, None, "invalid_api_key")
        assert_error(c.get("/v1/models", headers={"Authorization": "Bearer nope"}), 401, None)
        ok = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200
        assert c.get("/health").status_code == 200  # probes stay open


def test_error_helpers():
    fields = {"temperature": "temperature", "logprobs": "top_logprobs"}
    assert param_from_message("temperature must be >= 0, got -1", fields) == "temperature"
    assert param_from_message("logprobs must be None or an integer", fields) == "top_logprobs"
    assert param_from_message("something else", fields) is None
    assert _loc_to_param(("body", "messages", 0, "content")) == "messages[0].content"
    assert _loc_to_param(("body", "stop", "str")) == "stop"
    assert _loc_to_param(("body", 12)) is None
    # the client's name wherever the message names the field, never inside a flag
    msg = "max_tokens 9 is too large: lower max_tokens (or --max-model-len, --max-tokens)"
    renamed = {"max_tokens": "max_completion_tokens"}
    assert in_api_terms(msg, renamed, renamed) == (
        "max_completion_tokens 9 is too large: lower max_completion_tokens (or "
        "--max-model-len, --max-tokens)", "max_completion_tokens")
    # named later in a message about another field (helper-54)
    assert in_api_terms("min_tokens must be <= max_tokens, got 5", {"min_tokens": "min_tokens",
                                                                    **renamed}, renamed) == (
        "min_tokens must be <= max_completion_tokens, got 5", "min_tokens")


def test_server_start_freezes_the_heap_out_of_the_collector():
    """The start-up heap is frozen once the engine starts: full collections on the event loop
    would otherwise rescan it (50-170 ms each under connection churn, every stream waiting)."""
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    with TestClient(build_app(AsyncLLM(FakeEngine(max_model_len=64)), ServerSettings())) as c:
        assert gc.get_freeze_count() > 0
        assert c.get("/health").status_code == 200


def test_a_chats_tools_are_read_off_the_event_loop(client, monkeypatch):
    """Their dicts for the template (and a forced call's schema) are built on a front-end
    thread: 20,000 tools held every other stream 1.4 s on the event loop."""
    from kiln.entrypoints.openai import serving_chat

    threads = threads_calling(monkeypatch, serving_chat, "plan_tools")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for body in ({"tools": [tool], "tool_choice": "none"}, {}):
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body})
        assert r.status_code == 200, r.text
    assert threads[0].startswith("kiln-frontend") and not threads[1].startswith("kiln-frontend")


def test_fields_nothing_reads_are_named_in_the_log(client, caplog):
    """vLLM's warning: a misspelled field otherwise leaves its default at work without a word;
    OpenAI's fields that change nothing here (store, metadata) and accepted values pass."""
    body = dict(prompt="x", max_tokens=1, temprature=0.5, store=False, metadata={"a": "b"},
                truncation_side="left")
    with caplog.at_level("WARNING", logger="kiln.entrypoints.openai.protocol"):
        assert client.post("/v1/completions", json=body).status_code == 200
        assert client.post("/v1/chat/completions", json=dict(
            messages=[{"role": "user", "content": "x"}], modalities=["text"])).status_code == 200
    ignored = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert ignored == ["request fields Kiln does not read, ignored: temprature"], ignored


def test_prompt_logprobs_0_streams_as_vllm_takes_it(client):
    """vLLM takes prompt_logprobs=0 with stream=true (no chunk shows them) and refuses more
    (or -1): 0 was a 400 here. The engine is not asked to compute what no chunk carries; an
    echo with logprobs still scores the echoed prompt at the request's count."""
    from kiln.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from kiln.entrypoints.openai.sampling import chat_sampling_params, completion_sampling_params

    chat = dict(messages=[{"role": "user", "content": "x"}], max_tokens=3)
    for path, body in (("/v1/completions", dict(prompt="hello", max_tokens=3)),
                       ("/v1/chat/completions", chat)):
        events = sse_events(client, path, {**body, "stream": True, "prompt_logprobs": 0})
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert all(c.get("prompt_logprobs") is None for e in events for c in e["choices"])
        for n in (1, -1):
            r = client.post(path, json={**body, "stream": True, "prompt_logprobs": n})
            assert_error(r, 400, "prompt_logprobs", "invalid_value")
    assert chat_sampling_params(ChatCompletionRequest(
        **chat, stream=True, prompt_logprobs=0)).prompt_logprobs is None
    streamed = dict(prompt="hello", max_tokens=3, stream=True, prompt_logprobs=0)
    assert completion_sampling_params(CompletionRequest(**streamed)).prompt_logprobs is None
    assert completion_sampling_params(CompletionRequest(
        **streamed, echo=True, logprobs=2)).prompt_logprobs == 0
