"""vLLM's /v1/load_lora_adapter (VLLM_ALLOW_RUNTIME_LORA_UPDATING) against the fake engine: the
served adapters change on the event loop only (the adapter is read on a front-end thread), and
an empty name or path is a 400 naming it."""
import asyncio
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai.api_server import ServerSettings, build_app

from .fake_api import assert_error
from .fake_engine import FakeEngine


class _LoopOnlyDict(dict):
    """The served adapters, refusing a change made where no event loop runs: such a change
    raced GET /v1/models iterating them (RuntimeError: dictionary changed size)."""

    def _on_loop(self):
        asyncio.get_running_loop()  # RuntimeError on a front-end thread

    def __setitem__(self, key, value):
        self._on_loop()
        super().__setitem__(key, value)

    def pop(self, *args):
        self._on_loop()
        return super().pop(*args)


@pytest.fixture
def client(monkeypatch):
    engine = FakeEngine()
    checked = []
    engine.input_processor = SimpleNamespace(lora_checker=SimpleNamespace(
        check=lambda lora: checked.append(lora) or lora))
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    app = build_app(AsyncLLM(engine), ServerSettings())
    app.state.models.loras = _LoopOnlyDict()
    with TestClient(app) as c:
        yield c, checked


def test_adapters_are_added_and_removed_on_the_event_loop(client):
    c, checked = client
    for name in ("a", "b"):
        r = c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": "/x"})
        assert r.status_code == 200, r.text
    r = c.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/y",
                                               "load_inplace": True})
    assert r.status_code == 200, r.text
    ids = [lora.lora_int_id for lora in checked]
    assert len(set(ids)) == 3  # a replaced adapter gets a new id
    assert [m["id"] for m in c.get("/v1/models").json()["data"]][1:] == ["a", "b"]
    assert c.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200
    assert [m["id"] for m in c.get("/v1/models").json()["data"]][1:] == ["b"]


@pytest.mark.parametrize("field", ["lora_name", "lora_path"])
def test_an_empty_name_or_path_is_refused_naming_it(client, field):
    c, checked = client
    body = {"lora_name": "a", "lora_path": "/x", field: ""}
    assert_error(c.post("/v1/load_lora_adapter", json=body), 400, field, "invalid_value")
    assert not checked
