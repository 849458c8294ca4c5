"""A pooling server's /v1/embeddings with a LoRA adapter's name as `model`: the pooling runner
does not apply adapters (LLM.embed refuses lora_request), so the request is refused naming
`model`, not answered with the base model's vector under the adapter's name."""
import pytest
from fastapi.testclient import TestClient

from kiln.engine.arg_utils import EngineArgs
from kiln.engine.async_llm import AsyncLLM
from kiln.engine.llm_engine import LLMEngine
from kiln.entrypoints.openai.api_server import ServerSettings, build_app
from kiln.lora.serving import lora_module_flag

pytestmark = pytest.mark.usefixtures("inprocess_core")


def test_embeddings_refuse_an_adapter_model(lora_setup):
    base, adapter = lora_setup["base"], lora_setup["adapters"]["a1"]
    args = EngineArgs(model=str(base), enforce_eager=True, compilation_config=0,
                      max_model_len=64, enable_lora=True, runner="pooling")
    llm = AsyncLLM(LLMEngine(args.create_kiln_config()))
    settings = ServerSettings(served_model_names=["m"],
                              lora_modules=[lora_module_flag(f"sql={adapter}")])
    with TestClient(build_app(llm, settings)) as client:
        ok = client.post("/v1/embeddings", json={"model": "m", "input": [5, 6, 7]})
        assert ok.status_code == 200, ok.text
        r = client.post("/v1/embeddings", json={"model": "sql", "input": [5, 6, 7]})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "model" and "LoRA" in error["message"]
