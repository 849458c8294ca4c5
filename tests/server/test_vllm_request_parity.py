"""Request fields as vLLM's server takes them: n up to KILN_MAX_N_SEQUENCES (vLLM's
VLLM_MAX_N_SEQUENCES) rather than OpenAI's 128, beams included; current vLLM's
`repetition_detection` object beside its earlier flat fields (what it does:
test_request_fields.py, on a real engine)."""
import pytest
from fastapi.testclient import TestClient

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai.api_server import ServerSettings, build_app

from .fake_api import assert_error
from .fake_engine import FakeEngine

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
_BODIES = {CMPL: dict(prompt="x", max_tokens=1),
           CHAT: dict(messages=[{"role": "user", "content": "x"}], max_tokens=1)}


@pytest.fixture(scope="module")
def client():
    app = build_app(AsyncLLM(FakeEngine(max_model_len=64)), ServerSettings())
    with TestClient(app) as c:
        yield c


@pytest.fixture(autouse=True)
def _no_n_limit_set(monkeypatch):
    for name in ("KILN_MAX_N_SEQUENCES", "VLLM_MAX_N_SEQUENCES"):
        monkeypatch.delenv(name, raising=False)


def test_n_past_openais_128_is_served(client):
    r = client.post(CMPL, json={**_BODIES[CMPL], "n": 200})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 200


@pytest.mark.parametrize("path", [CMPL, CHAT])
@pytest.mark.parametrize("beam", [False, True])
@pytest.mark.parametrize("variable", ["KILN_MAX_N_SEQUENCES", "VLLM_MAX_N_SEQUENCES"])
def test_n_past_the_variables_limit_is_a_400_naming_n_and_the_variable(
        client, monkeypatch, path, beam, variable):
    monkeypatch.setenv(variable, "4")
    extra = {"use_beam_search": True} if beam else {}
    err = assert_error(client.post(path, json={**_BODIES[path], "n": 5, **extra}), 400, "n",
                       "invalid_value")
    assert "at most 4" in err["message"] and variable in err["message"], err
    if not beam:  # the fake engine runs no beam search (test_beam_search_server.py does)
        assert client.post(path, json={**_BODIES[path], "n": 4}).status_code == 200


def test_the_schema_states_the_n_limit(monkeypatch):
    """The smaller of the variable's limit and --max-sequences-per-request (prompts x n)."""
    def n_bounds(**settings):  # a new app: the schema is built once, at its first request
        app = build_app(AsyncLLM(FakeEngine(max_model_len=64)), ServerSettings(**settings))
        schemas = app.openapi()["components"]["schemas"]
        return {(b["minimum"], b["maximum"])
                for model in ("CompletionRequest", "ChatCompletionRequest")
                for b in schemas[model]["properties"]["n"]["anyOf"]
                if b.get("type") == "integer"}

    assert n_bounds(max_sequences_per_request=100_000) == {(1, 16_384)}
    assert n_bounds() == {(1, 256)}
    monkeypatch.setenv("VLLM_MAX_N_SEQUENCES", "7")
    assert n_bounds() == {(1, 7)}


_DETECTION = {"max_pattern_size": 2, "min_count": 3}


@pytest.mark.parametrize("path", [CMPL, CHAT])
@pytest.mark.parametrize("extra,param,code", [
    # null inside is a 400, as vLLM's int fields make it (not off)
    (dict(repetition_detection={"max_pattern_size": None}), "repetition_detection.max_pattern_size",
     None),
    (dict(repetition_detection={"max_pattern_size": -1}), "repetition_detection.max_pattern_size",
     None),
    (dict(repetition_detection={"max_pattern_size": 2, "min_count": 1}),
     "repetition_detection.min_count", "invalid_value"),
    (dict(repetition_detection={"max_pattern_size": 1, "min_pattern_size": 2, "min_count": 2}),
     "repetition_detection.min_pattern_size", "invalid_value"),
    (dict(repetition_detection="on"), "repetition_detection", None),
    (dict(repetition_detection={"min_pattern_size": 2}), "repetition_detection.min_pattern_size",
     "invalid_value"),  # a size with none above it: vLLM's min <= max
    # past what crosses to the engine core, even where no size turns it on
    (dict(repetition_detection={"min_count": 2**63}), "repetition_detection.min_count", None),
    # the object and the flat fields are one setting: given both, neither is picked
    (dict(repetition_detection=_DETECTION, repetition_min_count=3), "repetition_detection",
     "invalid_value"),
    (dict(repetition_detection=_DETECTION, use_beam_search=True), "use_beam_search",
     "unsupported_parameter"),
])
def test_the_repetition_detection_object_is_checked_as_vllm_checks_it(client, path, extra, param,
                                                                      code):
    err = assert_error(client.post(path, json={**_BODIES[path], **extra}), 400, param, code)
    assert param.split(".")[-1] in err["message"] or "repetition_detection" in err["message"]


# off with a min_count but no size, as vLLM's RepetitionDetectionParams takes it
@pytest.mark.parametrize("detection", [None, {}, {"max_pattern_size": 0}, {"min_count": 3},
                                       _DETECTION])
def test_the_repetition_detection_object_is_taken(client, detection):
    body = {**_BODIES[CHAT], "repetition_detection": detection}
    assert client.post(CHAT, json=body).status_code == 200


def test_the_schema_states_the_repetition_detection_object():
    app = build_app(AsyncLLM(FakeEngine(max_model_len=64)), ServerSettings())
    schemas = app.openapi()["components"]["schemas"]
    for model in ("CompletionRequest", "ChatCompletionRequest"):
        assert {"$ref": "#/components/schemas/RepetitionDetection"} in \
            schemas[model]["properties"]["repetition_detection"]["anyOf"]
    props = schemas["RepetitionDetection"]["properties"]
    assert props["max_pattern_size"]["type"] == "integer"  # not null: a 400, as vLLM's
    assert (props["max_pattern_size"]["minimum"], props["max_pattern_size"]["maximum"]) == \
        (0, 1024)
    assert set(props) == {"max_pattern_size", "min_pattern_size", "min_count"}
