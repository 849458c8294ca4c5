"""Fixtures shared by the server tests: one live `kiln serve` for the modules that ask for the
same flags (a start-up costs seconds on 2 shared cores)."""
import openai
import pytest

from .test_server_e2e import KEY
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
