"""The server's LoRA adapters (vLLM's --lora-modules): listed in /v1/models with `parent`, a
request's `model` picks the adapter (completions and chat), an unknown name is vLLM's 404."""
import pytest
from fastapi.testclient import TestClient

from kiln.engine.arg_utils import EngineArgs
from kiln.engine.async_llm import AsyncLLM
from kiln.engine.llm_engine import LLMEngine
from kiln.entrypoints.openai.api_server import ServerSettings, build_app
from kiln.lora.serving import lora_module_flag

pytestmark = pytest.mark.usefixtures("inprocess_core")


@pytest.fixture(scope="module")
def served(lora_setup):
    base, adapter = lora_setup["base"], lora_setup["adapters"]["a1"]
    prompt = lora_setup["prompts"][0]
    refs = {"m": lora_setup["refs"][None][0], "sql": lora_setup["refs"]["a1"][0]}
    args = EngineArgs(model=str(base), enforce_eager=True, max_model_len=64, enable_lora=True)
    llm = AsyncLLM(LLMEngine(args.create_kiln_config()))
    settings = ServerSettings(served_model_names=["m"],
                              lora_modules=[lora_module_flag(f"sql={adapter}")])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
        app = build_app(llm, settings)
    with TestClient(app) as c:
        yield c, prompt, refs, str(adapter)


def test_models_lists_adapters_with_parent(served):
    client, _, _, path = served
    cards = {c["id"]: c for c in client.get("/v1/models").json()["data"]}
    assert {"m", "sql"} <= set(cards)
    assert cards["sql"]["parent"] == "m" and cards["sql"]["root"] == path
    assert cards["m"]["parent"] is None


def test_model_field_picks_the_adapter(served):
    client, prompt, refs, _ = served
    for model in ("m", "sql", "m"):
        r = client.post("/v1/completions", json=dict(model=model, prompt=prompt, max_tokens=6,
                                                     temperature=0, ignore_eos=True, logprobs=0,
                                                     return_tokens_as_token_ids=True))
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        tokens = r.json()["choices"][0]["logprobs"]["tokens"]
        assert [int(t.removeprefix("token_id:")) for t in tokens] == refs[model]
    r = client.post("/v1/chat/completions", json=dict(
        model="sql", messages=[{"role": "user", "content": "w5"}], max_tokens=3))
    assert r.status_code == 200 and r.json()["model"] == "sql", r.text


def test_unknown_model_is_404_and_beam_search_refused(served):
    client, prompt, _, _ = served
    r = client.post("/v1/completions", json=dict(model="nope", prompt=prompt, max_tokens=2))
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and "nope" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json=dict(model="sql", prompt=prompt, max_tokens=2,
                                                 use_beam_search=True, n=2))
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search", r.text


def test_runtime_load_and_unload(served):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    client, prompt, refs, path = served
    body = dict(model="sql2", prompt=prompt, max_tokens=6, temperature=0, ignore_eos=True,
                logprobs=0, return_tokens_as_token_ids=True)
    assert client.post("/v1/completions", json=body).status_code == 404
    r = client.post("/v1/load_lora_adapter", json=dict(lora_name="sql2", lora_path=path))
    assert r.status_code == 200 and "added successfully" in r.text, r.text
    r = client.post("/v1/load_lora_adapter", json=dict(lora_name="sql2", lora_path=path))
    assert r.status_code == 400 and "already been loaded" in r.text
    assert "sql2" in {c["id"] for c in client.get("/v1/models").json()["data"]}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    assert [int(t.removeprefix("token_id:")) for t in tokens] == refs["sql"]
    r = client.post("/v1/load_lora_adapter", json=dict(lora_name="bad", lora_path="/nope"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
    r = client.post("/v1/unload_lora_adapter", json=dict(lora_name="sql2"))
    assert r.status_code == 200 and "removed successfully" in r.text
    assert client.post("/v1/completions", json=body).status_code == 404
    assert client.post("/v1/unload_lora_adapter", json=dict(lora_name="sql2")).status_code == 404


def test_embeddings_with_an_adapter_name_are_refused_not_base_vectors(lora_setup):
    """A pooling server with --lora-modules: /v1/embeddings under an adapter's name answered
    the base model's vectors (the adapter silently dropped); it is refused, naming `model`,
    as offline LLM.embed(lora_request=...) is."""
    args = EngineArgs(model=str(lora_setup["base"]), enforce_eager=True, max_model_len=64,
                      enable_lora=True, runner="pooling")
    llm = AsyncLLM(LLMEngine(args.create_kiln_config()))
    settings = ServerSettings(served_model_names=["m"], lora_modules=[
        lora_module_flag(f"sql={lora_setup['adapters']['a1']}")])
    with TestClient(build_app(llm, settings)) as client:
        assert client.post("/v1/embeddings", json=dict(model="m", input="w5 w6")).status_code == 200
        r = client.post("/v1/embeddings", json=dict(model="sql", input="w5 w6"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text


def test_lora_requests_info_on_metrics(served):
    """vLLM's vllm:lora_requests_info (kiln: for vllm:): the adapters in use as labels, the
    time as the value; a series whose adapters changed is replaced, not kept."""
    import time

    from prometheus_client.parser import text_string_to_metric_families

    from kiln.entrypoints.openai.metrics import ServerMetrics

    client = served[0]

    def series(text):
        return [(s.labels, s.value) for f in text_string_to_metric_families(text)
                for s in f.samples if s.name == "kiln:lora_requests_info"]

    (labels, value), = series(client.get("/metrics").text)
    assert labels == {"max_lora": "1", "waiting_lora_adapters": "",
                      "running_lora_adapters": ""}
    assert abs(value - time.time()) < 3600  # a timestamp (seconds), as vLLM's
    metrics = ServerMetrics("m", log_interval=None, max_lora=2)
    metrics.update_gauges({"running_lora_adapters": ["a", "b"], "waiting_lora_adapters": ["c"]})
    metrics.update_gauges({"running_lora_adapters": ["a"], "waiting_lora_adapters": []})
    (labels, _), = series(metrics.render().decode())
    assert labels == {"max_lora": "2", "waiting_lora_adapters": "", "running_lora_adapters": "a"}
    assert series(ServerMetrics("m", log_interval=None).render().decode()) == []  # no LoRA
