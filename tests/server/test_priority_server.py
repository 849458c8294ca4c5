"""The server's `priority` field under --scheduling-policy priority: completions and chat carry
it to the core's requests (an n > 1 request's samples too, a list of prompts each); the order
it gives is tests/core/test_request_queue.py's and test_priority_e2e.py's."""
import pytest
from fastapi.testclient import TestClient

from kiln.engine.arg_utils import EngineArgs
from kiln.engine.async_llm import AsyncLLM
from kiln.engine.llm_engine import LLMEngine
from kiln.entrypoints.openai.api_server import ServerSettings, build_app

pytestmark = pytest.mark.usefixtures("inprocess_core")  # reads the scheduler's requests


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    args = EngineArgs(model=str(tiny_llama_dir), enforce_eager=True, max_model_len=64,
                      block_size=4, scheduling_policy="priority")
    llm = AsyncLLM(LLMEngine(args.create_kiln_config()))
    scheduler = llm.engine.engine_core.core.scheduler
    seen: list[tuple[str, int]] = []
    add = scheduler.add_request

    def spy(request):
        seen.append((request.request_id, request.priority))
        add(request)

    scheduler.add_request = spy
    app = build_app(llm, ServerSettings(served_model_names=["m"]))
    with TestClient(app) as c:
        yield c, seen


def test_completions_and_chat_carry_priority_to_every_sample(served):
    client, seen = served
    r = client.post("/v1/completions", json=dict(prompt=["w5 w6", "w7"], max_tokens=3, n=2,
                                                 temperature=0.5, seed=1, priority=-4))
    assert r.status_code == 200, r.text
    assert len(seen) == 4 and {p for _, p in seen} == {-4}
    seen.clear()
    r = client.post("/v1/chat/completions", json=dict(
        messages=[{"role": "user", "content": "w5"}], max_tokens=3, priority=9))
    assert r.status_code == 200, r.text
    assert [p for _, p in seen] == [9]
    seen.clear()
    r = client.post("/v1/completions", json=dict(prompt="w5", max_tokens=3))
    assert r.status_code == 200 and [p for _, p in seen] == [0]  # vLLM's default


@pytest.mark.parametrize("bad", [1.5, "1", True, 2**63, -2**63 - 1])
def test_a_priority_that_is_no_int64_is_a_400_naming_it(served, bad):
    client, seen = served
    for path, body in (("/v1/completions", dict(prompt="w5")),
                       ("/v1/chat/completions",
                        dict(messages=[{"role": "user", "content": "w5"}]))):
        r = client.post(path, json=dict(body, max_tokens=2, priority=bad))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "priority", r.text
