"""The chat form of the pooling routes (vLLM's EmbeddingChatRequest, ClassificationChatRequest,
PoolingChatRequest): `messages` rendered by the chat template with vLLM's pooling defaults
(no generation prompt, no extra special tokens), pooled as HF pools the rendered ids (tiny
random Qwen3s, eager, float32 both sides), and the refusals naming the field."""
import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from kiln.engine.arg_utils import EngineArgs
from kiln.engine.async_llm import AsyncLLM
from kiln.engine.llm_engine import LLMEngine
from kiln.entrypoints.openai.api_server import ServerSettings, build_app
from pooling.hf_pooled import hf_logits, hf_pooled

ATOL = 2e-5  # float32 both sides
CHAT = [{"role": "system", "content": "w9 w10"}, {"role": "user", "content": "w5 w6 w7"},
        {"role": "assistant", "content": "w11"}]


def _client(model_dir, **engine):
    args = EngineArgs(model=str(model_dir), compilation_config=0, max_model_len=64,
                      max_num_seqs=4, kv_cache_memory=0.02, **engine)
    llm = AsyncLLM(LLMEngine(args.create_kiln_config()))
    return TestClient(build_app(llm, ServerSettings(served_model_names=["m"])))


@pytest.fixture(scope="module")
def embedder(tiny_qwen3_dir, inprocess_core):
    with _client(tiny_qwen3_dir, runner="pooling") as c:
        yield c


@pytest.fixture(scope="module")
def classifier(tiny_cls_qwen3_dir, inprocess_core):
    with _client(tiny_cls_qwen3_dir) as c:
        yield c


def _rendered_ids(model_dir, messages, **kwargs) -> list[int]:
    """HF's render of the chat, tokenized as the template wrote it (no special tokens)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(messages, tokenize=False, **kwargs)
    return tok(text, add_special_tokens=False)["input_ids"]


def test_embeddings_of_messages_match_hf_on_the_rendered_chat(embedder, tiny_qwen3_dir):
    r = embedder.post("/v1/embeddings", json={"messages": CHAT, "model": "m"})
    assert r.status_code == 200, r.json()
    body = r.json()
    ids = _rendered_ids(tiny_qwen3_dir, CHAT, add_generation_prompt=False)
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert len(body["data"]) == 1 and body["data"][0]["index"] == 0
    ref = hf_pooled(tiny_qwen3_dir, [ids], "LAST", True)[0]
    torch.testing.assert_close(torch.tensor(body["data"][0]["embedding"]), ref, atol=ATOL,
                               rtol=0)
    # the ids the template renders, given as input, embed the same
    same = embedder.post("/v1/embeddings", json={"input": ids}).json()["data"][0]
    torch.testing.assert_close(torch.tensor(same["embedding"]), ref, atol=ATOL, rtol=0)
    # add_generation_prompt opens the assistant turn; continue_final_message leaves the last
    # message open; template kwargs reach the template
    opened = _rendered_ids(tiny_qwen3_dir, CHAT, add_generation_prompt=True)
    r = embedder.post("/v1/embeddings", json={"messages": CHAT, "add_generation_prompt": True})
    assert r.json()["usage"]["prompt_tokens"] == len(opened) == len(ids) + 1
    torch.testing.assert_close(torch.tensor(r.json()["data"][0]["embedding"]),
                               hf_pooled(tiny_qwen3_dir, [opened], "LAST", True)[0],
                               atol=ATOL, rtol=0)
    cont = _rendered_ids(tiny_qwen3_dir, CHAT, continue_final_message=True)
    r = embedder.post("/v1/embeddings", json={"messages": CHAT, "continue_final_message": True})
    assert r.json()["usage"]["prompt_tokens"] == len(cont)
    # /pooling takes messages too (vLLM's PoolingChatRequest)
    pooled = embedder.post("/pooling", json={"messages": CHAT}).json()["data"][0]
    torch.testing.assert_close(torch.tensor(pooled["data"]), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("body, param, words", [
    ({"input": "w5", "messages": CHAT}, "input", "exactly one of input or messages"),
    ({}, "input", "exactly one of input or messages (the body has neither)"),
    ({"messages": []}, "messages", "messages is empty"),
    ({"messages": CHAT, "add_generation_prompt": True, "continue_final_message": True},
     "continue_final_message", "cannot both be true"),
    ({"messages": CHAT, "chat_template": "{{ messages }}"}, "chat_template",
     "--trust-request-chat-template"),
    ({"messages": [{"role": "user", "content": " ".join(["w5"] * 70)}]}, "messages",
     "maximum context length is 64 tokens"),
])
def test_chat_errors_name_the_field(embedder, body, param, words):
    r = embedder.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.json()
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_classify_and_pooling_take_messages(classifier, tiny_cls_qwen3_dir):
    ids = _rendered_ids(tiny_cls_qwen3_dir, CHAT, add_generation_prompt=False)
    ref = hf_logits(tiny_cls_qwen3_dir, [ids])[0].softmax(-1)
    r = classifier.post("/classify", json={"messages": CHAT, "model": "m"})
    assert r.status_code == 200, r.json()
    data = r.json()["data"][0]
    torch.testing.assert_close(torch.tensor(data["probs"]), ref, atol=ATOL, rtol=0)
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    pooled = classifier.post("/pooling", json={"messages": CHAT}).json()["data"][0]
    torch.testing.assert_close(torch.tensor(pooled["data"]), ref, atol=ATOL, rtol=0)
    r = classifier.post("/classify", json={"messages": CHAT, "input": "w5"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
