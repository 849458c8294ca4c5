"""POST /v1/embeddings on a --runner pooling server (tiny random Qwen3, eager): OpenAI's body
and response, vectors equal to HF AutoModel's pooled and normalized, base64 = float, errors
naming the field; the generate endpoints answer vLLM's refusal, and a generate server's
/v1/embeddings names --runner pooling."""
import base64

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from kiln.engine.arg_utils import EngineArgs
from kiln.engine.async_llm import AsyncLLM
from kiln.engine.llm_engine import LLMEngine
from kiln.entrypoints.openai.api_server import ServerSettings, build_app
from pooling.hf_pooled import hf_pooled

from checkpoints import random_prompts

EMB = "/v1/embeddings"


def _client(model_dir, **engine):
    args = EngineArgs(model=str(model_dir), enforce_eager=True, compilation_config=0,
                      max_model_len=64, max_num_seqs=4, kv_cache_memory=0.02, **engine)
    llm = AsyncLLM(LLMEngine(args.create_kiln_config()))
    return TestClient(build_app(llm, ServerSettings(served_model_names=["m"])))


@pytest.fixture(scope="module")
def client(tiny_qwen3_dir, inprocess_core):
    # no prefix cache: a repeated batch computes the same positions, bit for bit
    with _client(tiny_qwen3_dir, runner="pooling", max_num_batched_tokens=16,
                 enable_prefix_caching=False) as c:
        yield c


def test_embeddings_match_hf_in_openais_shape(client, tiny_qwen3_dir):
    prompts = random_prompts(3, [4, 37, 64], seed=11)  # 37 and 64 run in chunks of 16
    r = client.post(EMB, json={"input": prompts, "model": "m", "user": "u1"})
    assert r.status_code == 200, r.json()
    body = r.json()
    assert body["object"] == "list" and body["model"] == "m"
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == 105
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert all(d["object"] == "embedding" for d in body["data"])
    for d, ref in zip(body["data"], hf_pooled(tiny_qwen3_dir, prompts, "LAST", True)):
        torch.testing.assert_close(torch.tensor(d["embedding"]), ref, atol=2e-5, rtol=0)
    # one list of ids is one input; base64 is OpenAI's little-endian float32
    one = client.post(EMB, json={"input": prompts[1]}).json()["data"]
    assert len(one) == 1  # alone vs in a batch: GEMM blocking differs in the last bits
    torch.testing.assert_close(torch.tensor(one[0]["embedding"]),
                               torch.tensor(body["data"][1]["embedding"]), atol=1e-6, rtol=0)
    b64 = client.post(EMB, json={"input": prompts, "encoding_format": "base64"}).json()
    for d, f in zip(b64["data"], body["data"]):
        decoded = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
        assert decoded.tolist() == np.asarray(f["embedding"], dtype=np.float32).tolist()


def test_text_inputs_and_normalize(client, tiny_qwen3_dir):
    r = client.post(EMB, json={"input": ["w5 w6 w7", "w9"]})
    assert r.status_code == 200, r.json()
    assert r.json()["usage"]["prompt_tokens"] > 0
    raw = client.post(EMB, json={"input": [[5, 6, 7]], "normalize": False}).json()["data"][0]
    ref = hf_pooled(tiny_qwen3_dir, [[5, 6, 7]], "LAST", False)[0]
    torch.testing.assert_close(torch.tensor(raw["embedding"]), ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("body, param, words", [
    ({"input": [5] * 65}, "input", "maximum context length is 64 tokens. However, you "
                                   "requested 65 tokens"),
    ({"input": [5, 6], "dimensions": 8}, "dimensions", "does not support matryoshka"),
    ({"input": []}, "input", "input is empty"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format", "'float' or 'base64'"),
    ({"input": [[5, 6], [9999]]}, "input", "outside the vocabulary"),
    ({"input": [5] * 70, "truncate_prompt_tokens": 65}, "truncate_prompt_tokens",
     "between 1 and max_model_len 64"),
    ({"input": [5], "priority": 2**70}, "priority", "64-bit integer's range"),
])
def test_errors_name_the_field(client, body, param, words):
    r = client.post(EMB, json=body)
    assert r.status_code == 400, r.json()
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_truncation_keeps_the_last_tokens(client):
    cut = client.post(EMB, json={"input": list(range(3, 83)), "truncate_prompt_tokens": 10})
    assert cut.status_code == 200, cut.json()
    last = client.post(EMB, json={"input": list(range(73, 83))}).json()
    torch.testing.assert_close(torch.tensor(cut.json()["data"][0]["embedding"]),
                               torch.tensor(last["data"][0]["embedding"]), atol=1e-6, rtol=0)
    assert cut.json()["usage"]["prompt_tokens"] == 10


def test_generate_endpoints_refuse_on_a_pooling_server(client):
    paths = client.get("/openapi.json").json()["paths"]  # the schema states what it serves
    assert "/v1/embeddings" in paths and "/v1/completions" not in paths
    for path, body, api in (("/v1/completions", {"prompt": "hi"}, "Completions"),
                            ("/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "hi"}]},
                             "Chat Completions")):
        r = client.post(path, json=body)
        assert r.status_code == 400
        assert r.json()["error"]["message"].startswith(f"The model does not support {api} API")


def test_a_generate_server_names_runner_pooling(tiny_llama_dir, inprocess_core):
    with _client(tiny_llama_dir) as c:
        r = c.post(EMB, json={"input": "hi"})
        assert "/v1/embeddings" not in c.get("/openapi.json").json()["paths"]
    assert r.status_code == 400
    assert "--runner pooling" in r.json()["error"]["message"]


def test_metrics_count_pooled_prompts(client):
    """vLLM counts a pooling request's prompt (and its time to the pooled output as a first
    token's): prompt_tokens_total stayed 0 on a pooling server."""
    from prometheus_client.parser import text_string_to_metric_families

    def totals() -> dict:
        return {s.name: s.value
                for f in text_string_to_metric_families(client.get("/metrics").text)
                for s in f.samples if s.name in ("kiln:prompt_tokens_total",
                                                 "kiln:time_to_first_token_seconds_count")}

    before = totals()
    r = client.post(EMB, json={"input": random_prompts(2, [4, 37], seed=4)})
    assert r.status_code == 200, r.json()
    after = totals()
    assert after["kiln:prompt_tokens_total"] - before["kiln:prompt_tokens_total"] == 41
    assert (after["kiln:time_to_first_token_seconds_count"]
            - before["kiln:time_to_first_token_seconds_count"]) == 2
