"""/classify, /score (/v1/score), /rerank (/v1, /v2) and /pooling on tiny random classifier
servers (eager), against HF transformers' *ForSequenceClassification: vLLM's bodies and
responses, the errors naming the field, and each route's refusal on a server whose runner or
task does not serve it."""
import pytest
import torch
from fastapi.testclient import TestClient

from kiln.engine.arg_utils import EngineArgs
from kiln.engine.async_llm import AsyncLLM
from kiln.engine.llm_engine import LLMEngine
from kiln.entrypoints.openai import serving_completion
from kiln.entrypoints.openai.api_server import ServerSettings, build_app
from pooling.hf_pooled import hf_logits

from checkpoints import random_prompts

ATOL = 1e-5  # float32 both sides


def _client(model_dir, settings=None, **engine):
    args = EngineArgs(model=str(model_dir), compilation_config=0, max_model_len=64,
                      max_num_seqs=4, kv_cache_memory=0.02, **engine)
    llm = AsyncLLM(LLMEngine(args.create_kiln_config()))
    return TestClient(build_app(llm, ServerSettings(served_model_names=["m"],
                                                    **(settings or {}))))


@pytest.fixture(scope="module")
def classifier(tiny_cls_qwen3_dir, inprocess_core):
    with _client(tiny_cls_qwen3_dir) as c:
        yield c


@pytest.fixture(scope="module")
def cross_encoder(tiny_ce_llama_dir, inprocess_core):
    with _client(tiny_ce_llama_dir) as c:
        yield c


def _in_schema(client, path: str, r) -> None:
    """`r`'s 200 body is what /openapi.json says the route answers (its response model)."""
    import jsonschema

    assert r.status_code == 200, r.json()
    schema = client.get("/openapi.json").json()
    ok = schema["paths"][path]["post"]["responses"]["200"]["content"]["application/json"]
    assert ok["schema"]["$ref"].endswith("Response"), ok  # a model, not FastAPI's `{}`
    jsonschema.Draft202012Validator({**ok["schema"], "components": schema["components"]}) \
        .validate(r.json())


def test_classify_matches_hf_in_vllms_shape(classifier, tiny_cls_qwen3_dir):
    prompts = random_prompts(3, [4, 37, 64], seed=11)
    r = classifier.post("/classify", json={"input": prompts, "model": "m"})
    _in_schema(classifier, "/classify", r)
    body = r.json()
    assert body["object"] == "list" and body["model"] == "m"
    assert body["id"].startswith("classify-")
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == 105
    refs = hf_logits(tiny_cls_qwen3_dir, prompts)
    for i, (d, ref) in enumerate(zip(body["data"], refs)):
        assert d["index"] == i and d["num_classes"] == 3
        torch.testing.assert_close(torch.tensor(d["probs"]), ref.softmax(-1), atol=ATOL,
                                   rtol=0)
        assert d["label"] == ("neg", "neu", "pos")[int(ref.argmax())]
    raw = classifier.post("/classify", json={"input": prompts[0], "use_activation": False})
    torch.testing.assert_close(torch.tensor(raw.json()["data"][0]["probs"]), refs[0],
                               atol=ATOL, rtol=0)
    text = classifier.post("/classify", json={"input": ["w5 w6", "w7"]}).json()
    assert [d["index"] for d in text["data"]] == [0, 1]
    pooled = classifier.post("/pooling", json={"input": prompts[0], "task": "classify"}
                             ).json()["data"][0]
    assert pooled["object"] == "pooling"
    torch.testing.assert_close(torch.tensor(pooled["data"]), refs[0].softmax(-1), atol=ATOL,
                               rtol=0)
    chat = classifier.post("/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "(a score head, no LM head)" in \
        chat.json()["error"]["message"]
    paths = classifier.get("/openapi.json").json()["paths"]
    assert "/classify" in paths and "/pooling" in paths and "/v1/embeddings" not in paths
    assert "/score" not in paths  # 3 labels: no cross-encoder


@pytest.mark.parametrize("path, body, param, words", [
    ("/classify", {"input": [5] * 65}, "input", "maximum context length is 64 tokens"),
    ("/classify", {"input": []}, "input", "input is empty"),
    ("/classify", {"input": "x", "activation": True, "use_activation": False},
     "use_activation", "disagree"),
    ("/classify", {"input": [[5], [9999]]}, "input", "outside the vocabulary"),
    # vLLM's /pooling task: another task's is refused, not answered with the classifier's
    ("/pooling", {"input": "x", "task": "embed"}, "task", "runs the pooling runner's classify"),
    ("/pooling", {"input": "x", "task": "token_classify"}, "task", "'token_classify' is not"),
    ("/v1/embeddings", {"input": "x"}, None, "does not support Embeddings API"),
    ("/score", {"text_1": "x", "text_2": "y"}, None, "this model has 3 labels"),
    ("/rerank", {"query": "x", "documents": ["y"]}, None, "does not support Rerank API"),
])
def test_classifier_errors_name_the_field(classifier, path, body, param, words):
    r = classifier.post(path, json=body)
    assert r.status_code == 400, r.json()
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_score_and_rerank_match_hf(cross_encoder, tiny_ce_llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_ce_llama_dir)
    query, docs = "w5 w6 w7", ["w8 w9", "w10 w11 w12 w13", "w7", "w30"]
    want = [torch.sigmoid(r).item() for r in hf_logits(
        tiny_ce_llama_dir, [tok(query, text_pair=d)["input_ids"] for d in docs])]
    for path, body in (("/score", {"text_1": query, "text_2": docs}),
                       ("/v1/score", {"queries": query, "documents": docs}),
                       ("/score", {"data_1": [query] * 4, "data_2": docs})):
        r = cross_encoder.post(path, json=body)
        _in_schema(cross_encoder, path, r)
        out = r.json()
        assert out["object"] == "list" and out["id"].startswith("score-")
        assert [d["index"] for d in out["data"]] == [0, 1, 2, 3]
        assert all(d["object"] == "score" for d in out["data"])
        for d, w in zip(out["data"], want):
            assert abs(d["score"] - w) < ATOL
    order = sorted(range(4), key=lambda i: -want[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = cross_encoder.post(path, json={"query": query, "documents": docs, "top_n": 2,
                                           "model": "m"})
        _in_schema(cross_encoder, path, r)
        out = r.json()
        assert out["model"] == "m" and out["id"].startswith("rerank-")
        assert [x["index"] for x in out["results"]] == order[:2]
        for x in out["results"]:
            assert x["document"] == {"text": docs[x["index"]]}
            assert abs(x["relevance_score"] - want[x["index"]]) < ATOL
        assert out["usage"]["total_tokens"] == sum(
            len(tok(query, text_pair=d)["input_ids"]) for d in docs)
    for top_n in (9, 0, -1):  # past the documents, or 0 or less (as vLLM's): every one
        every = cross_encoder.post("/rerank", json={"query": query, "documents": docs,
                                                    "top_n": top_n}).json()["results"]
        assert [x["index"] for x in every] == order


@pytest.mark.parametrize("path, body, param, words", [
    ("/rerank", {"query": "x", "documents": []}, "documents", "documents is empty"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1",
     "input lengths must be either 1:1, 1:N or N:N"),
    ("/score", {"text_1": "a"}, "text_2", "text_2 is missing"),
    ("/score", {"text_1": "w5 " * 40, "text_2": "w6 " * 40}, "text_2",
     "maximum context length is 64 tokens. However, you requested 80 tokens"),
    ("/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 65},
     "truncate_prompt_tokens", "between 1 and max_model_len 64"),
    ("/classify", {"input": "x", "softmax": "yes"}, "softmax", None),
])
def test_score_errors_name_the_field(cross_encoder, path, body, param, words):
    r = cross_encoder.post(path, json=body)
    assert r.status_code == 400, r.json()
    error = r.json()["error"]
    assert error["param"] == param and (words is None or words in error["message"]), error


def test_long_pairs_truncate_and_an_embedding_server_scores_by_cosine(
        cross_encoder, tiny_qwen3_dir, inprocess_core, monkeypatch):
    cut = cross_encoder.post("/score", json={"text_1": "w5 " * 40, "text_2": "w6 " * 40,
                                             "truncate_prompt_tokens": 64})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 64, cut.json()
    # --max-sequences-per-request 3: it counts the pairs (documents) an embedding model
    # scores too, though it pools the query besides
    with _client(tiny_qwen3_dir, {"max_sequences_per_request": 3}, runner="pooling") as c:
        three = c.post("/rerank", json={"query": "w5", "documents": ["w6", "w7", "w8"]})
        assert three.status_code == 200 and len(three.json()["results"]) == 3, three.json()
        pairs = c.post("/score", json={"text_1": ["w5", "w6"], "text_2": ["w7", "w8"]})
        assert pairs.status_code == 200, pairs.json()
        four = c.post("/score", json={"text_1": "w5", "text_2": ["w6"] * 4}).json()["error"]
        assert four["code"] == "too_many_sequences" and "asks for 4 prompt(s)" in \
            four["message"] and four["param"] == "text_2", four

        def tokenized(*_):
            raise AssertionError("tokenized before the cap refused the request")
        # the cap refuses before any text is tokenized (add_special_tokens false does it)
        with monkeypatch.context() as m:
            m.setattr(serving_completion, "without_special_tokens", tokenized)
            for path in ("/v1/embeddings", "/pooling"):
                many = c.post(path, json={"input": ["w5"] * 4, "add_special_tokens": False})
                assert many.json()["error"]["code"] == "too_many_sequences", many.json()
        vecs = [torch.tensor(d["embedding"]) for d in
                c.post("/v1/embeddings", json={"input": ["w5 w6", "w7", "w8 w9"]}).json()["data"]]
        r = c.post("/v1/score", json={"text_1": "w5 w6", "text_2": ["w7", "w8 w9"]})
        assert r.status_code == 200, r.json()
        for d, v in zip(r.json()["data"], vecs[1:]):
            assert abs(d["score"] - float(vecs[0] @ v)) < 1e-5
        ranked = c.post("/rerank", json={"query": "w5 w6", "documents": ["w7", "w8 w9"]})
        assert ranked.status_code == 200, ranked.json()
        assert c.post("/classify", json={"input": "x"}).status_code == 400
