"""Fixtures shared by the server tests: one live `kiln serve` for the modules that ask for the
same flags (a start-up costs seconds on 2 shared cores)."""
import contextlib
import os

import openai
import pytest

from .test_server_e2e import KEY, running_server, stories_with_chat_template
from .test_structured_server import _serve, tiny_qwen_chat


@pytest.fixture(scope="package")
def hermes_client(tmp_path_factory):
    """The tiny random Qwen2 served with `--tool-call-parser hermes --enable-auto-tool-choice`
    and the responses store on: test_structured_server's and test_tool_calls_server's server
    (the store matters to /v1/responses only, which the structured tests do not call)."""
    with _serve(tiny_qwen_chat(tmp_path_factory), tmp_path_factory, "--tool-call-parser",
                "hermes", "--enable-auto-tool-choice",
                env={"KILN_ENABLE_RESPONSES_API_STORE": "1"}) as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="package")
def stories_chat_server(tmp_path_factory):
    """A function giving (url, process) of a live `kiln serve` of stories260K with a chat
    template: test_server_e2e's and test_responses_server's server (64 sequences for the
    concurrency test, a 200,000-byte body limit for the 413 test, the responses store on for
    background responses; no test of either reads the other's settings). Started on first use
    and again if a test stopped it (test_server_e2e's SIGTERM test does, whatever the order)."""
    live: list = []
    with contextlib.ExitStack() as stack:
        def get():
            if not live or live[-1][1].poll() is not None:
                model = stories_with_chat_template(tmp_path_factory.mktemp("stories_chat"))
                env = dict(os.environ, KILN_API_KEY=KEY, KILN_LOGGING_LEVEL="WARNING",
                           KILN_ENABLE_RESPONSES_API_STORE="1")
                args = ["--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "64",
                        "--kv-cache-memory", "0.05", "--max-request-body-bytes", "200000",
                        "--disable-access-log", "--graceful-shutdown-timeout", "0.5",
                        "--uvicorn-log-level", "warning"]
                log = tmp_path_factory.mktemp("serve_log") / "serve.log"
                live.append(stack.enter_context(running_server(model, args, log, env)))
            return live[-1]

        yield get
