"""/openapi.json describes what the server does: 400 error bodies (not 422), the real content
types of /health, /metrics and streams, empty lists marked refused; schemathesis finds no
server error and no response outside the schema (a fake engine, a few examples per route)."""

import pytest

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai.api_server import ServerSettings, build_app

from .fake_engine import VOCAB, FakeEngine
from .uvicorn_thread import uvicorn_in_thread

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402 (schemathesis brings it)

APP = build_app(AsyncLLM(FakeEngine()), ServerSettings())
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
    case.call_and_validate(base_url=base_url, checks=CHECKS)


def test_the_schema_says_what_requests_the_server_refuses():
    """schemathesis' request-side checks (valid bodies accepted, invalid refused) need these."""
    schemas = SCHEMA["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]
    # token ids within the vocabulary; allowed_token_ids non-empty
    ids = [m for m in completion["allowed_token_ids"]["anyOf"] if m.get("type") == "array"][0]
    assert ids["minItems"] == 1 and ids["items"]["minimum"] == 0
    assert ids["items"]["maximum"] == VOCAB - 1
    # refused fields take only their off value; an optional field takes null
    assert {"const": False} in completion["use_beam_search"]["anyOf"]
    assert {"type": "null"} in schemas["TokenizeRequest"]["properties"]["return_token_strs"][
        "anyOf"]
    assert schemas["TextContentPart"]["properties"]["type"]["enum"] == ["text"]
    assert len(schemas["TokenizeRequest"]["anyOf"]) == 2  # prompt or messages


@pytest.mark.parametrize("field,value", [("seed", True), ("n", "2"), ("echo", 1),
                                         ("temperature", False)])
def test_json_types_are_not_coerced(base_url, field, value):
    import httpx

    r = httpx.post(f"{base_url}/v1/completions", json={"prompt": "hi", field: value},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert httpx.post(f"{base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2.0},
                      timeout=30).status_code == 200  # an integral number is an integer
