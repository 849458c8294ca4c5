"""The HTTP layer against a fake engine (no model): bad input named by field, the engine's death
as a 503, malformed bodies, the API key, the error helpers."""
import json

import pytest
from fastapi.testclient import TestClient

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai.api_server import ServerSettings, build_app
from kiln.entrypoints.openai.errors import _loc_to_param, in_api_terms, param_from_message

from . import fake_api
from .fake_api import assert_error
from .fake_engine import FakeEngine

client = fake_api.client  # the fixture: this module's client on a fake engine


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
        ("guided_whitespace_pattern", " *"),
        ("truncation_side", "right"), ("logprob_token_ids", [1]),
        ("thinking_token_budget", 10)]],
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}],
                                  max_completion_tokens=3, min_tokens=5), "min_tokens", None),
    # a structural tag (vLLM's older top-level field) without its format
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}],
                                  structural_tag="{}"), "structural_tag", "invalid_value"),
    # -1 (the whole vocabulary) past --max-logprobs names the field sent (it said "prompt")
    ("/v1/completions", dict(prompt="x", logprobs=-1), "logprobs", None),
    ("/v1/completions", dict(prompt="x", prompt_logprobs=-1), "prompt_logprobs", None),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}], logprobs=True,
                                  top_logprobs=-1), "top_logprobs", None),
    # --max-sequences-per-request (256 here): each choice is built in the engine at once
    ("/v1/completions", dict(prompt="x", n=257), "n", "too_many_sequences"),
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


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", dict(prompt="hello", max_tokens=2)),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}], max_tokens=2))])
@pytest.mark.parametrize("field", ["max_repetition_pattern_size", "min_repetition_pattern_size",
                                   "repetition_min_count"])
def test_repetition_detection_fields_refuse_null_as_vllm_does(client, path, body, field):
    """vLLM types them int (not optional): a null is a 400 there, which Kiln took as 0 (off)."""
    err = assert_error(client.post(path, json={**body, field: None}), 400, field)
    assert err["message"].startswith(f"{field}: ")


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


_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("extra, param, shown", [
    (dict(repetition_detection={"max_pattern_size": 2, "min_count": 2}), "use_beam_search",
     'repetition_detection={"max_pattern_size": 2, "min_count": 2} is refused with '
     "use_beam_search=true: beam search does not apply it; omit it"),
    (dict(tools=_TOOLS, tool_choice={"type": "function", "function": {"name": "f"}}),
     "tool_choice", 'tool_choice={"type": "function", "function": {"name": "f"}} is refused '
     'with use_beam_search=true: beam search follows no grammar; give tool_choice "auto" or '
     '"none", or drop use_beam_search'),
    (dict(stream=True), "use_beam_search", "stream=true is refused"),
    (dict(response_format={"type": "json_object"}), "use_beam_search",
     'response_format={"type": "json_object"} is refused with use_beam_search=true: beam '
     "search follows no grammar; omit it"),
    (dict(use_beam_search=False, modalities=["audio"]), "modalities",
     'modalities=["audio"] is refused: the model writes text only; omit it'),
])
def test_refusals_show_the_value_as_the_client_wrote_it(client, extra, param, shown):
    """Beam search's refusals showed Python's repr of what read the field
    (RepetitionDetection(max_pattern_size=2, ...), NamedToolChoice(type='function', ...),
    stream=True): now the JSON the client sent, with the fix."""
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
            "use_beam_search": True, "n": 2, **extra}
    err = assert_error(client.post("/v1/chat/completions", json=body), 400, param,
                       "unsupported_parameter")
    assert err["message"].startswith(shown), err
    assert "(" not in err["message"].split(" is refused")[0], err


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
