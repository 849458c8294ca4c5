"""A request's own chat_template (vLLM's --trust-request-chat-template): rendered where the
server trusts it, for chat completions and /tokenize alike; a 400 naming the flag where not.
"""
import pytest
from fastapi.testclient import TestClient

from kiln.engine.arg_utils import EngineArgs
from kiln.engine.async_llm import AsyncLLM
from kiln.engine.llm_engine import LLMEngine
from kiln.entrypoints.cli.main import build_parser
from kiln.entrypoints.cli.serve import settings_from_args
from kiln.entrypoints.openai.api_server import ServerSettings, build_app

# The engine core in this process: what is tested is the engine, not its process (a core
# process costs an interpreter start per engine; test_core_process.py covers that one).
pytestmark = pytest.mark.usefixtures("inprocess_core")

SERVER_TEMPLATE = "{% for m in messages %}w4 {{ m['content'] }} {% endfor %}w3"
# Renders every message twice, so its prompt is visibly not the server's.
REQUEST_TEMPLATE = "{% for m in messages %}w9 {{ m['content'] }} {{ m['content'] }} {% endfor %}"
MESSAGES = [{"role": "user", "content": "w5 w6"}]


def client_for(model_dir, trusted: bool) -> tuple[TestClient, LLMEngine]:
    """A server on a fresh engine (closing a server shuts its engine down)."""
    args = EngineArgs(model=str(model_dir), enforce_eager=True, max_model_len=64,
                      block_size=4, chat_template=SERVER_TEMPLATE)
    engine = LLMEngine(args.create_kiln_config())
    app = build_app(AsyncLLM(engine), ServerSettings(served_model_names=["m"],
                                                     trust_request_chat_template=trusted))
    return TestClient(app), engine


def prompt_ids(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


def test_trusted_server_renders_the_requests_template(tiny_llama_dir):
    client, engine = client_for(tiny_llama_dir, trusted=True)
    with client as c:
        r = c.post("/tokenize", json=dict(messages=MESSAGES, chat_template=REQUEST_TEMPLATE))
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == prompt_ids(engine, "w9 w5 w6 w5 w6 ")
        body = dict(model="m", messages=MESSAGES, max_tokens=2, temperature=0)
        own = c.post("/v1/chat/completions", json={**body, "chat_template": REQUEST_TEMPLATE})
        assert own.status_code == 200, own.text
        assert own.json()["usage"]["prompt_tokens"] == 5
        # An empty template is none (vLLM's `or`): the server's renders.
        server = c.post("/v1/chat/completions", json={**body, "chat_template": ""}).json()
        assert server["usage"]["prompt_tokens"] == len(prompt_ids(engine, "w4 w5 w6 w3"))
        # A template that fails to render is the request's error, named as such.
        bad = c.post("/v1/chat/completions", json={**body, "chat_template": "{% if %}"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "chat_template_error"
        # One that fails in its own code: the error says so once, and the server goes on.
        bad = c.post("/v1/chat/completions", json={**body, "chat_template": "{{ 1/0 }}"})
        assert bad.status_code == 400 and bad.json()["error"]["message"] == (
            "the chat template does not render: ZeroDivisionError: division by zero")
        assert c.post("/v1/chat/completions", json=body).status_code == 200


@pytest.mark.parametrize("path,extra", [
    ("/v1/chat/completions", dict(model="m", max_tokens=2)), ("/tokenize", {})])
def test_untrusted_server_refuses_a_requests_template_naming_the_flag(tiny_llama_dir, path,
                                                                     extra):
    with client_for(tiny_llama_dir, trusted=False)[0] as c:
        r = c.post(path, json=dict(messages=MESSAGES, chat_template=REQUEST_TEMPLATE, **extra))
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "chat_template"
        assert "--trust-request-chat-template" in error["message"]
        # A template smuggled through the template's variables is refused either way.
        r = c.post(path, json=dict(messages=MESSAGES, **extra,
                                   chat_template_kwargs={"chat_template": REQUEST_TEMPLATE}))
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_the_flag_reaches_the_settings():
    parser = build_parser()
    assert not settings_from_args(parser.parse_args(["serve"])).trust_request_chat_template
    args = parser.parse_args(["serve", "--trust-request-chat-template"])
    assert settings_from_args(args).trust_request_chat_template
