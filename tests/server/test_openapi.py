"""/openapi.json describes what the server does: 400 error bodies (not 422), the real content
types of /health, /metrics and streams, empty lists marked refused, the rules across fields;
schemathesis with every check (its CLI's `--checks all`, every phase) finds nothing outside
the few rules JSON Schema cannot state (a fake engine, a few examples per route)."""

import pytest

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai.api_server import ServerSettings, build_app
from kiln.entrypoints.openai.openapi import decimal_below

from .fake_engine import VOCAB, FakeEngine
from .uvicorn_thread import uvicorn_in_thread

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402 (schemathesis brings it)

# A context long enough for what schemathesis sends (a real model's is thousands of tokens): a
# prompt over max_model_len is a 400 no schema can state.
APP = build_app(AsyncLLM(FakeEngine(max_model_len=1024)), ServerSettings())
SCHEMA = APP.openapi()


def test_errors_are_400_openai_bodies_and_content_types_are_real():
    for path, item in SCHEMA["paths"].items():
        for operation in item.values():
            responses = operation["responses"]
            assert "422" not in responses, path
            if "400" in responses:
                ref = responses["400"]["content"]["application/json"]["schema"]["$ref"]
                assert ref.endswith("/ErrorResponse"), path
    assert SCHEMA["paths"]["/health"]["get"]["responses"]["200"]["content"] == {}
    assert list(SCHEMA["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == \
        ["text/plain"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert "text/event-stream" in \
            SCHEMA["paths"][path]["post"]["responses"]["200"]["content"]
    schemas = SCHEMA["components"]["schemas"]
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
    prompt_arrays = [s for s in schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
                     if s.get("type") == "array"]
    assert prompt_arrays and all(s["minItems"] == 1 for s in prompt_arrays)


@pytest.fixture(scope="module")
def base_url():
    """APP on uvicorn in a thread (schemathesis' in-process ASGI client would run the app's
    lifespan, and its shutdown, once per call)."""
    with uvicorn_in_thread(APP) as port:
        yield f"http://127.0.0.1:{port}"


api = schemathesis.openapi.from_dict(SCHEMA)
CHECKS = [schemathesis.checks.not_a_server_error, schemathesis.checks.status_code_conformance,
          schemathesis.checks.content_type_conformance,
          schemathesis.checks.response_schema_conformance]


@api.parametrize()
@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_server_error_and_every_response_in_the_schema(case, base_url):
    # schemathesis' 10 s default timed out once on a loaded host (n=64 samples of hundreds of
    # fake tokens each): the checks are about the answer, not its speed.
    case.call_and_validate(base_url=base_url, checks=CHECKS, timeout=60)


_CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": ["hi", [5, 6]], "max_tokens": 3, "n": 2, "logprobs": 2,
                         "echo": True, "return_token_ids": True, "prompt_logprobs": 1}),
    ("/v1/chat/completions", {"messages": _CHAT, "max_tokens": 3, "logprobs": True,
                              "top_logprobs": 2, "return_token_ids": True}),
    ("/v1/completions", {"prompt": ["hi", [5, 6]], "max_tokens": 3, "n": 2, "logprobs": 2,
                         "echo": True, "return_token_ids": True, "stream": True,
                         "stream_options": {"include_usage": True,
                                            "continuous_usage_stats": True}}),
    ("/v1/chat/completions", {"messages": _CHAT, "max_tokens": 3, "n": 2, "logprobs": True,
                              "top_logprobs": 2, "return_token_ids": True, "stream": True,
                              "stream_options": {"include_usage": True}})])
def test_bodies_and_stream_events_are_the_schemas(base_url, path, body):
    """A 200's JSON body, and every event of a stream (its chunks, then [DONE]), validate
    against the schema (a stream's events once had a string's schema: each event failed)."""
    content = SCHEMA["paths"][path]["post"]["responses"]["200"]["content"]
    assert set(content["text/event-stream"]) == {"itemSchema"}  # per event, as FastAPI's
    api[path]["POST"].Case(body=body).call_and_validate(base_url=base_url, checks=CHECKS)


def _schema_takes(model: str, body: dict) -> bool:
    import jsonschema

    root = {"$ref": f"#/components/schemas/{model}", "components": SCHEMA["components"]}
    return jsonschema.Draft202012Validator(root).is_valid(body)


_TURN = {"messages": _CHAT, "continue_final_message": True}


@pytest.mark.parametrize("path,model,body", [
    # an empty bad word is refused
    ("/v1/completions", "CompletionRequest", {"prompt": "hi", "bad_words": [""]}),
    ("/v1/completions", "CompletionRequest", {"prompt": "hi", "bad_words": ["a"]}),
    # continue_final_message refuses an explicit add_generation_prompt=true only
    *[(path, model, {**_TURN, **extra})
      for path, model in (("/tokenize", "TokenizeRequest"),
                          ("/v1/chat/completions", "ChatCompletionRequest"))
      for extra in ({}, {"add_generation_prompt": None}, {"add_generation_prompt": False},
                    {"add_generation_prompt": True})],
    # top_logprobs needs logprobs=true; stream_options needs stream=true; prompt_logprobs
    # are not streamed, but 0 is taken (as vLLM); a field null is as absent
    *[("/v1/chat/completions", "ChatCompletionRequest", {"messages": _CHAT, **extra})
      for extra in ({"top_logprobs": 2}, {"top_logprobs": 2, "logprobs": False},
                    {"top_logprobs": 2, "logprobs": True}, {"top_logprobs": None},
                    {"stream_options": {}, "stream": True}, {"stream_options": {}},
                    {"prompt_logprobs": 0, "stream": True},
                    {"prompt_logprobs": 2, "stream": True})],
    *[("/v1/completions", "CompletionRequest", {"prompt": "hi", **extra})
      for extra in ({"stream_options": {"include_usage": True}},
                    {"stream_options": {}, "stream": False}, {"stream_options": None},
                    {"stream_options": {}, "stream": True}, {"prompt_logprobs": 1},
                    {"prompt_logprobs": 1, "stream": True},
                    {"prompt_logprobs": 0, "stream": True},
                    {"prompt_logprobs": None, "stream": True})],
    # a max_tokens past max_model_len - 1 never fits
    ("/v1/completions", "CompletionRequest", {"prompt": "", "max_tokens": 1023}),
    ("/v1/completions", "CompletionRequest", {"prompt": "", "max_tokens": 1024}),
    ("/v1/chat/completions", "ChatCompletionRequest",
     {"messages": _CHAT, "max_completion_tokens": 1024})])
def test_the_schema_takes_what_the_server_takes(base_url, path, model, body):
    """The rules across fields the schema states: its verdict on a body is the server's
    (cases schemathesis found where the two disagreed, its positive data refused or its
    negative data accepted, and the rules it once could not take)."""
    import httpx

    status = httpx.post(f"{base_url}{path}", json={"max_tokens": 1, **body}
                        if path != "/tokenize" else body, timeout=30).status_code
    assert status in (200, 400)
    assert _schema_takes(model, body) == (status == 200), (body, status)


def test_every_operation_has_its_own_id():
    """/ping's GET and POST, one route, shared one operationId (FastAPI warned; clients
    generated from the schema clash)."""
    ids = [op["operationId"] for path in SCHEMA["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids)), sorted(ids)
    assert {"get", "post"} <= set(SCHEMA["paths"]["/ping"])
    # the same on every start, whatever PYTHONHASHSEED orders the route's methods by
    assert {m: op["operationId"] for m, op in SCHEMA["paths"]["/ping"].items()} == {
        "get": "health_ping_get", "post": "health_ping_post"}


def test_the_schema_says_what_requests_the_server_refuses():
    """schemathesis' request-side checks (valid bodies accepted, invalid refused) need these."""
    schemas = SCHEMA["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]
    # token ids within the vocabulary; allowed_token_ids non-empty
    ids = [m for m in completion["allowed_token_ids"]["anyOf"] if m.get("type") == "array"][0]
    assert ids["minItems"] == 1 and ids["items"]["minimum"] == 0
    assert ids["items"]["maximum"] == VOCAB - 1
    # an empty bad word is refused, and more than the cap on bad_words x n (at n=1)
    from kiln.sampling_params import MAX_BAD_WORDS_PER_REQUEST
    for model in ("CompletionRequest", "ChatCompletionRequest"):
        words = schemas[model]["properties"]["bad_words"]["anyOf"]
        assert {"type": "array", "items": {"type": "string", "minLength": 1},
                "maxItems": MAX_BAD_WORDS_PER_REQUEST} in words
    # refused fields take only their off value; an optional field takes null
    assert {"const": "left"} in completion["truncation_side"]["anyOf"]
    assert {"type": "boolean"} in completion["spaces_between_special_tokens"]["anyOf"]
    assert {"type": "null"} in schemas["TokenizeRequest"]["properties"]["return_token_strs"][
        "anyOf"]
    assert schemas["TextContentPart"]["properties"]["type"]["enum"] == ["text"]
    assert len(schemas["TokenizeRequest"]["anyOf"]) == 2  # prompt or messages
    # chat's max_tokens rule, which the schema leaves unbounded (_INEXPRESSIBLE_ON), is stated
    rule = schemas["ChatCompletionRequest"]["properties"]["max_tokens"]["description"]
    assert "max_completion_tokens is absent or null" in rule and "at most 1023" in rule


@pytest.mark.parametrize("field,value", [("seed", True), ("n", "2"), ("echo", 1),
                                         ("temperature", False)])
def test_json_types_are_not_coerced(base_url, field, value):
    import httpx

    r = httpx.post(f"{base_url}/v1/completions", json={"prompt": "hi", field: value},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert httpx.post(f"{base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2.0},
                      timeout=30).status_code == 200  # an integral number is an integer


# Refusals no JSON schema can state, each a 400 naming its field: a JSON schema, regex, grammar
# or structural tag that does not compile; a named tool_choice that `tools` does not define;
# min_tokens above max_tokens (no comparison between fields); a prompt and max_tokens past
# max_model_len (counted in tokens). And one a JSON schema can state but schemathesis cannot
# take beside the others (openapi._SWITCHES): parallel_tool_calls=false needs tools.
# schemathesis' positive data may hit them.
# use_beam_search=true with a field the search ignores (stream, stop, ...), or length_penalty
# without it: another split past the canonicalizer's budget (it gave up on the chat schema).
# Repetition detection: min_repetition_pattern_size above max_repetition_pattern_size (a
# comparison), and repetition_min_count >= 2 where a pattern size is set, a size where a count
# is (one more split); the same inside the repetition_detection object, and the object beside
# the flat fields.
_INEXPRESSIBLE = {"guided_json", "guided_regex", "guided_grammar", "structural_tag",
                  "structured_outputs",
                  "response_format", "tool_choice", "min_tokens", "parallel_tool_calls",
                  "use_beam_search", "min_repetition_pattern_size", "repetition_min_count",
                  "max_repetition_pattern_size", "repetition_detection",
                  "repetition_detection.min_pattern_size", "repetition_detection.min_count",
                  "repetition_detection.max_pattern_size",
                  "text.format"}  # /v1/responses' response_format: a schema that compiles


@pytest.mark.parametrize("store", ["0", "1"])
def test_responses_fields_that_need_the_store_are_off_without_it(store, monkeypatch):
    """previous_response_id and background are refused (400) without the response store: the
    schema says null / false then, so schemathesis' positive data never sends them (it drew a
    previous_response_id once and failed positive_data_acceptance)."""
    monkeypatch.setenv("KILN_ENABLE_RESPONSES_API_STORE", store)
    monkeypatch.delenv("VLLM_ENABLE_RESPONSES_API_STORE", raising=False)
    app = build_app(AsyncLLM(FakeEngine(max_model_len=1024)), ServerSettings())
    props = app.openapi()["components"]["schemas"]["ResponsesRequest"]["properties"]
    if store == "1":
        assert {"type": "string"} in props["previous_response_id"]["anyOf"]
        assert {"type": "boolean"} in props["background"]["anyOf"]
    else:
        assert props["previous_response_id"] == {"type": "null", "title": "Previous Response Id"}
        assert props["background"] == {"enum": [None, False], "title": "Background"}


@pytest.mark.parametrize("n", [1, 2, 10, 100, 101, 49152])
def test_token_id_keys_pattern_is_exactly_the_vocabulary(n):
    """logit_bias keys are token ids as decimal strings: the schema's pattern takes exactly the
    ones the server takes (leading zeros too), so schemathesis draws no key it refuses."""
    import re

    pattern = re.compile(decimal_below(n))
    for v in range(n + 120):
        for key in (str(v), f"0{v}"):
            assert bool(pattern.fullmatch(key)) == (v < n), key
    assert not any(pattern.fullmatch(k) for k in ("", "+1", " 1", "-0", "1.0", "a"))


def test_logit_bias_keys_are_bounded_by_the_vocabulary():
    for model in ("CompletionRequest", "ChatCompletionRequest"):
        bias = SCHEMA["components"]["schemas"][model]["properties"]["logit_bias"]
        names = [m["propertyNames"] for m in bias["anyOf"] if "propertyNames" in m]
        assert names == [{"pattern": decimal_below(VOCAB)}]


# Chat's max_tokens is checked only where max_completion_tokens (which overrides it) is absent,
# as vLLM's: a third switch beside stream and logprobs outgrows schemathesis' canonicalizer
# (openapi_cross_field._SWITCHES), so the schema leaves chat's max_tokens unbounded.
# A function_call_output must answer a function_call before it (in the input, or in the
# response previous_response_id continues): a rule across items, refused naming the item.
_INEXPRESSIBLE_ON = {("POST /v1/chat/completions", "max_tokens"),
                     ("POST /v1/responses", "input[].call_id")}


def _allowed(label: str, check: str, status: int | None, body: bytes | None) -> bool:
    import json
    import re

    if check != "positive_data_acceptance" or status != 400 or not body:
        return False
    error = json.loads(body)["error"]
    item = re.sub(r"\[\d+\]", "[]", error["param"] or "")  # input[3].call_id: input[].call_id
    return error["type"] == "invalid_request_error" and (
        error["param"] in _INEXPRESSIBLE or (label, item) in _INEXPRESSIBLE_ON
        or error["code"] == "context_length_exceeded")


def test_every_schemathesis_check_passes(base_url):
    """The engine schemathesis' CLI runs (`st run --checks all`: examples, coverage, fuzzing,
    positive and negative data), in-process, seeded."""
    from schemathesis.engine import events, from_schema

    schema = schemathesis.openapi.from_dict(SCHEMA)
    schema.config.update(base_url=base_url)
    schema.config.checks.update(included_check_names=["all"])
    schema.config.generation.update(max_examples=5, modes=["positive", "negative"],
                                    database="none")  # the same cases every run
    schema.config.seed = 1
    cases, failures, errors = 0, [], []
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            recorder = event.recorder
            cases += len(recorder.cases)
            for case_id, checks in recorder.checks.items():
                response = getattr(recorder.interactions.get(case_id), "response", None)
                status = getattr(response, "status_code", None)
                body = getattr(response, "content", None)
                failures += [(recorder.label, c.name, status, body) for c in checks
                             if c.failure_info is not None
                             and not _allowed(recorder.label, c.name, status, body)]
        elif isinstance(event, (events.NonFatalError, events.FatalError)):
            errors.append(str(getattr(event, "info", event)))
    assert not errors, errors
    assert not failures, failures[:5]
    assert cases > 500  # every phase ran


@pytest.mark.parametrize("metrics_public", [False, True])
def test_the_key_is_stated_and_enforced(metrics_public):
    """With --api-key the schema says every route takes a bearer key but /health, /ping (and
    /metrics when public); schemathesis' ignored_auth check finds each route refusing a missing or
    wrong key."""
    app = build_app(AsyncLLM(FakeEngine(max_model_len=1024)),
                    ServerSettings(api_key="k", metrics_public=metrics_public))
    schema = app.openapi()
    assert schema["security"] == [{"apiKey": []}]
    assert schema["components"]["securitySchemes"]["apiKey"] == {"type": "http",
                                                                 "scheme": "bearer"}
    open_paths = {"/health", "/ping"} | ({"/metrics"} if metrics_public else set())
    assert {path for path, item in schema["paths"].items()
            if item[next(iter(item))].get("security") == []} == open_paths
    keyed = schemathesis.openapi.from_dict(schema)
    routes = [("/health", "GET", None), ("/metrics", "GET", None), ("/v1/models", "GET", None),
              ("/tokenize", "POST", {"prompt": "hi"}), ("/detokenize", "POST", {"tokens": [5]}),
              ("/v1/completions", "POST", {"prompt": "hi", "max_tokens": 1}),
              ("/v1/chat/completions", "POST", {"messages": _CHAT, "max_tokens": 1}),
              ("/v1/responses", "POST", {"input": "hi", "max_output_tokens": 1})]
    with uvicorn_in_thread(app) as port:
        for path, method, body in routes:
            given = {"body": body} if body is not None else {}
            keyed[path][method].Case(headers={"Authorization": "Bearer k"}, **given) \
                .call_and_validate(base_url=f"http://127.0.0.1:{port}",
                                   checks=[*CHECKS, schemathesis.checks.ignored_auth])
