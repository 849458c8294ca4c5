"""The HTTP layer against a fake engine (no model): completion and chat shapes, SSE, logprobs,
echo. Errors and auth: test_api_fake_engine_errors.py; tokenize and metrics: _front_end.py."""
import pytest

from . import fake_api
from .fake_api import MODEL, assert_error, sse_events

client = fake_api.client  # the fixture: this module's client on a fake engine


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
