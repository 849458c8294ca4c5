"""VLLM_SERVER_DEV_MODE=1 (KILN_SERVER_DEV_MODE): vLLM's POST /reset_prefix_cache, which a
benchmark moved from vLLM calls between runs; it was a 404 and every run after the first
measured a warm prefix cache."""
import threading

import pytest
from fastapi.testclient import TestClient

from kiln.engine.arg_utils import EngineArgs
from kiln.engine.async_llm import AsyncLLM
from kiln.engine.llm_engine import LLMEngine
from kiln.entrypoints.openai.api_server import build_app
from kiln.entrypoints.openai.server_settings import ServerSettings


@pytest.fixture  # the server shuts its engine down when it stops
def engine(tiny_llama_dir):
    args = EngineArgs(model=str(tiny_llama_dir), enforce_eager=True, max_model_len=64,
                      block_size=4, enable_prefix_caching=True)
    return LLMEngine(args.create_kiln_config(), multiprocess=False)


def cached_tokens(client) -> int:
    r = client.post("/v1/completions", json={"model": "m", "prompt": list(range(5, 25)),
                                             "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def test_dev_mode_serves_reset_prefix_cache(engine, monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    app = build_app(AsyncLLM(engine), ServerSettings(served_model_names=["m"],
                                                     enable_prompt_tokens_details=True))
    with TestClient(app) as c:
        cached_tokens(c)
        assert cached_tokens(c) > 0  # the second run hits the prefix cache
        assert c.post("/reset_prefix_cache").status_code == 200
        assert cached_tokens(c) == 0
        assert c.post("/reset_prefix_cache?reset_running_requests=true").status_code == 200
        assert "/reset_prefix_cache" in c.get("/openapi.json").json()["paths"]


def test_without_dev_mode_there_is_no_reset_endpoint(engine, monkeypatch):
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    monkeypatch.delenv("KILN_SERVER_DEV_MODE", raising=False)
    with TestClient(build_app(AsyncLLM(engine), ServerSettings(served_model_names=["m"]))) as c:
        assert c.post("/reset_prefix_cache").status_code == 404


def test_dev_mode_serves_sleep_wake_up_and_collective_rpc(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    args = EngineArgs(model=str(tiny_llama_dir), enforce_eager=True, max_model_len=64,
                      enable_sleep_mode=True)
    engine = LLMEngine(args.create_kiln_config(), multiprocess=False)
    with TestClient(build_app(AsyncLLM(engine), ServerSettings(served_model_names=["m"]))) as c:
        assert c.get("/is_sleeping").json() == {"is_sleeping": False}
        assert c.post("/sleep?level=1").status_code == 200
        assert c.get("/is_sleeping").json() == {"is_sleeping": True}
        assert engine.engine_core.executor.worker.model_runner.attention_layers[
            "model.layers.0.self_attn.attn"].kv_cache is None
        assert c.post("/wake_up?tags=weights").status_code == 200
        assert c.get("/is_sleeping").json() == {"is_sleeping": True}  # the KV cache sleeps
        assert c.post("/wake_up?tags=kv_cache").status_code == 200
        assert c.get("/is_sleeping").json() == {"is_sleeping": False}
        r = c.post("/v1/completions", json={"model": "m", "prompt": [5, 6, 7], "max_tokens": 2})
        assert r.status_code == 200, r.text
        for bad in ("/sleep?level=5", "/sleep?mode=drop", "/wake_up?tags=gpu"):
            r = c.post(bad)
            assert r.status_code == 400 and "error" in r.json(), (bad, r.text)
        r = c.post("/collective_rpc", json={"method": "weights_missing"})
        assert r.json() == {"results": ["0"]}  # vLLM sends non-JSON results as str
        r = c.post("/collective_rpc", json={"method": "nope"})
        assert r.status_code == 400 and "no method 'nope'" in r.json()["error"]["message"]
        assert c.post("/collective_rpc", json={"args": []}).status_code == 400
        # past its timeout: a 504 naming the method and the timeout; the call runs on and the
        # engine waits for it
        release = threading.Event()
        engine.engine_core.executor.worker.held = release.wait
        r = c.post("/collective_rpc", json={"method": "held", "timeout": 0.05})
        assert r.status_code == 504 and r.json()["error"]["param"] == "timeout", r.text
        assert "'held' did not finish within its timeout of 0.05 s" in \
            r.json()["error"]["message"]
        release.set()
        assert c.post("/collective_rpc", json={"method": "held"}).json() == {"results": ["True"]}
        r = c.post("/collective_rpc", json={"method": "held", "timeout": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "timeout"


def test_dev_routes_answer_a_shutdown_or_a_dead_engine_with_a_503(monkeypatch):
    """/sleep, /wake_up, /is_sleeping, /reset_prefix_cache and /collective_rpc once the server
    is shutting down (or the engine died) answer as a generation request does: a 503,
    server_shutting_down or engine_dead. They were 500 internal_error, logged as unhandled."""
    from .fake_engine import FakeEngine

    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    calls = (("get", "/is_sleeping"), ("post", "/sleep"), ("post", "/wake_up"),
             ("post", "/reset_prefix_cache"), ("post", "/collective_rpc"))
    for end, code in (("abort_all", "server_shutting_down"), ("died", "engine_dead")):
        llm = AsyncLLM(FakeEngine())
        with TestClient(build_app(llm, ServerSettings()), raise_server_exceptions=False) as c:
            if end == "abort_all":
                c.portal.call(llm.abort_all, "the server is shutting down")
            else:
                c.portal.call(llm.start)
                c.portal.call(llm._fail_all, RuntimeError("core gone"))
            for method, path in calls:
                r = c.request(method, path, json={"method": "weights_missing"})
                assert r.status_code == 503, (path, r.text)
                assert r.json()["error"]["code"] == code, (path, r.text)
