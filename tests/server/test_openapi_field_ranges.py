"""Single fields whose schema once disagreed with the server on a real model (helper60's
field-by-field sweep of /openapi.json against `kiln serve`): the schema took logprobs -1 that
the engine's max_logprobs refuses, seeds past 64 bits and an empty cache_salt the server
refuses, and refused the empty truncation_side / modalities the server takes as off."""
import pytest

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai.api_server import ServerSettings, build_app

from .fake_engine import VOCAB, FakeEngine
from .uvicorn_thread import uvicorn_in_thread

APP = build_app(AsyncLLM(FakeEngine(max_model_len=1024)), ServerSettings())
SCHEMA = APP.openapi()
_CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def base_url():
    with uvicorn_in_thread(APP) as port:
        yield f"http://127.0.0.1:{port}"


def _schema_takes(model: str, body: dict) -> bool:
    import jsonschema

    root = {"$ref": f"#/components/schemas/{model}", "components": SCHEMA["components"]}
    return jsonschema.Draft202012Validator(root).is_valid(body)


_CASES = [(field, value) for field in ("logprobs", "prompt_logprobs") for value in (-1, 0, 20)] \
    + [("seed", v) for v in (2**63 - 1, 2**63, -2**63, -2**63 - 1)] \
    + [("top_k", v) for v in (2**63 - 1, 2**63)] \
    + [("temperature", 3e38), ("temperature", 1e39)] \
    + [("cache_salt", ""), ("cache_salt", "s"), ("truncation_side", ""),
       ("truncation_side", "left"), ("truncation_side", "right")]


@pytest.mark.parametrize("field,value", _CASES)
def test_completion_field_schema_verdict_is_the_servers(base_url, field, value):
    import httpx

    body = {"prompt": "hi", "max_tokens": 1, field: value}
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=30)
    assert r.status_code in (200, 400), r.text
    assert _schema_takes("CompletionRequest", body) == (r.status_code == 200), (body, r.text)


@pytest.mark.parametrize("value", [[], ["text"], ["audio"]])
def test_chat_modalities_schema_verdict_is_the_servers(base_url, value):
    import httpx

    body = {"messages": _CHAT, "max_tokens": 1, "modalities": value}
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30)
    assert _schema_takes("ChatCompletionRequest", body) == (r.status_code == 200), (body, r.text)


def test_whole_vocabulary_logprobs_are_stated_only_where_the_cap_allows():
    from kiln.entrypoints.openai.openapi_sampling import sampling_ranges

    def minimum(cap, name="logprobs"):
        schema = {"properties": {name: {"anyOf": [{"type": "integer"}]}}}
        sampling_ranges(schema, cap, VOCAB)
        return schema["properties"][name]["anyOf"][0]["minimum"]

    assert minimum(20) == 0 and minimum(VOCAB) == -1
    # chat's top_logprobs=-1 is the whole vocabulary too (the server takes it; the schema said
    # 0 at least)
    assert minimum(20, "top_logprobs") == 0 and minimum(VOCAB, "top_logprobs") == -1
    # a --max-logprobs past the vocabulary: the server refuses more than the vocabulary holds
    schema = {"properties": {"logprobs": {"anyOf": [{"type": "integer"}]}}}
    sampling_ranges(schema, VOCAB * 10, VOCAB)
    assert schema["properties"]["logprobs"]["anyOf"][0]["maximum"] == VOCAB



def test_tokenize_add_special_tokens_defaults_by_input_as_the_schema_says(base_url):
    """/openapi.json said add_special_tokens defaults to true; for messages the server's
    default is false, as vLLM's (helper-60): the schema's default is null, described."""
    import httpx

    prop = SCHEMA["components"]["schemas"]["TokenizeRequest"]["properties"]["add_special_tokens"]
    assert prop.get("default") is None and "false for messages" in prop["description"]
    with_bos = httpx.post(f"{base_url}/tokenize", json={"prompt": "hi"}).json()["tokens"]
    assert with_bos[0] == 1  # the fake tokenizer's BOS
    assert httpx.post(f"{base_url}/tokenize", json={"prompt": "hi", "add_special_tokens": False}
                      ).json()["tokens"] == with_bos[1:]
    chat = [httpx.post(f"{base_url}/tokenize", json={"messages": _CHAT, **extra}).json()["tokens"]
            for extra in ({}, {"add_special_tokens": False}, {"add_special_tokens": True})]
    assert chat[0] == chat[1] and chat[2] == [1] + chat[0]
