"""vLLM's Qwen3-Reranker conversion (--hf-overrides architectures Qwen3ForSequenceClassification,
classifier_from_token ["no", "yes"], is_original_qwen3_reranker): a tiny random Qwen3ForCausalLM
served as a 1-label cross-encoder scores each pair as HF's P(yes) over {no, yes} at the last
position of text_1 + text_2 (float32 both sides), offline and through /rerank and /score, tied
or not; an explicit chat template renders the pair; the config keys' refusals name them."""
import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM, AutoTokenizer

from kiln.config.hf_config_snapshot import HFConfigSnapshot
from kiln.engine.arg_utils import EngineArgs
from kiln.engine.async_llm import AsyncLLM
from kiln.engine.llm_engine import LLMEngine
from kiln.entrypoints.llm import LLM
from kiln.entrypoints.openai.api_server import ServerSettings, build_app
from kiln.errors import ConfigError
from kiln.pooling.token_classifier import classifier_token_ids, resolve_token_classifier

from checkpoints import make_tiny_checkpoint

ATOL = 1e-5  # float32 both sides; observed ~3e-8
OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"],
             "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}
ENGINE = dict(max_model_len=64, max_num_seqs=4, kv_cache_memory=0.02, compilation_config=0,
              hf_overrides=OVERRIDES)
QUERY = "<|im_start|>user\nThe quick brown fox"
DOCS = [" jumps over the lazy dog<|im_end|>\n", " true, false, null<|im_end|>\n",
        " 0123456789<|im_end|>\n"]
SCORE_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                  "<|im_end|>\n{% endfor %}")


def _reranker(path, tie: bool, seed: int):
    """A Qwen3ForCausalLM with a byte-level tokenizer that spells "no" and "yes" as tokens."""
    make_tiny_checkpoint(path, "qwen3", tie=tie, seed=seed, tokenizer="chat")
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(["no", "yes"])
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory):
    return _reranker(tmp_path_factory.mktemp("qwen3_reranker"), tie=False, seed=4)


def hf_p_yes(model_dir, texts: list[str]) -> list[float]:
    """HF's Qwen3-Reranker score: softmax over the (no, yes) logits at the last position."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    no, yes = tok.convert_tokens_to_ids(["no", "yes"])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.softmax(model(torch.tensor([tok(t)["input_ids"]])).logits[0, -1, [no, yes]],
                              -1)[1].item() for t in texts]


def test_config_keys_resolve_as_vllms_and_refuse_by_name():
    base = {"model_type": "qwen3", "architectures": ["Qwen3ForSequenceClassification"]}
    resolved = resolve_token_classifier(HFConfigSnapshot({**base, **OVERRIDES}))
    assert resolved.method == "from_2_way_softmax" and resolved.num_labels == 1
    assert len(resolved.id2label) == 1 and resolved.use_sep_token is False
    kept = resolve_token_classifier(HFConfigSnapshot({**base, **OVERRIDES,
                                                      "use_sep_token": True}))
    assert kept.use_sep_token is True
    three = resolve_token_classifier(HFConfigSnapshot({**base, "method": "no_post_processing",
                                                       "classifier_from_token": ["a", "b", "c"]}))
    assert len(three.id2label) == 3
    plain = HFConfigSnapshot(base)
    assert resolve_token_classifier(plain) is plain
    for extra, words in [
        ({"model_type": "llama"}, "is_original_qwen3_reranker converts a Qwen3 checkpoint"),
        ({"classifier_from_token": ["yes"]}, "from_2_way_softmax takes two"),
        ({"method": "no_post_processing"}, "means method from_2_way_softmax"),
        ({"is_original_qwen3_reranker": False}, "classifier_from_token needs a method"),
        ({"is_original_qwen3_reranker": False, "method": "softmax"}, "'softmax' is not supp"),
        ({"classifier_from_token": "yes"}, "needs classifier_from_token, a list"),
    ]:
        with pytest.raises(ConfigError, match=words):
            resolve_token_classifier(HFConfigSnapshot({**base, **OVERRIDES, **extra}))


def test_classifier_tokens_must_be_vocabulary_tokens(reranker_dir):
    tok = AutoTokenizer.from_pretrained(reranker_dir)
    assert classifier_token_ids(tok, ["no", "yes"]) == tok.convert_tokens_to_ids(["no", "yes"])
    with pytest.raises(ConfigError, match="classifier_from_token 'maybe' is not a token"):
        classifier_token_ids(tok, ["no", "maybe"])


@pytest.mark.parametrize("tie", [False, True])
def test_offline_score_is_hfs_p_yes(reranker_dir, tmp_path, tie, inprocess_core):
    model_dir = _reranker(tmp_path / "tied", tie=True, seed=5) if tie else reranker_dir
    refs = hf_p_yes(model_dir, [QUERY + d for d in DOCS])
    llm = LLM(model=str(model_dir), **ENGINE)
    try:
        assert llm.llm_engine.get_supported_tasks() == ("classify", "score", "encode")
        outs = llm.score(QUERY, DOCS, use_tqdm=False)
        torch.testing.assert_close(torch.tensor([o.outputs.score for o in outs]),
                                   torch.tensor(refs), atol=ATOL, rtol=0)
        # the pair is text_1 + text_2 tokenized as one text (use_sep_token false), as vLLM's
        tok = AutoTokenizer.from_pretrained(model_dir)
        assert outs[0].prompt_token_ids == tok(QUERY + DOCS[0])["input_ids"]
        if tie:
            return
        # classify: the one label's sigmoid, the same number
        probs = llm.classify(QUERY + DOCS[1], use_tqdm=False)[0].outputs.probs
        assert probs == pytest.approx([refs[1]], abs=ATOL)
        # an explicit chat template renders the pair as "query" and "document" messages
        rendered = [tok.apply_chat_template([{"role": "query", "content": QUERY},
                                             {"role": "document", "content": d}],
                                            chat_template=SCORE_TEMPLATE, tokenize=False)
                    for d in DOCS[:2]]
        templated = llm.score(QUERY, DOCS[:2], use_tqdm=False, chat_template=SCORE_TEMPLATE)
        torch.testing.assert_close(torch.tensor([o.outputs.score for o in templated]),
                                   torch.tensor(hf_p_yes(model_dir, rendered)), atol=ATOL,
                                   rtol=0)
    finally:
        llm.shutdown()


def test_rerank_and_score_routes_are_hfs_p_yes(reranker_dir, inprocess_core):
    refs = hf_p_yes(reranker_dir, [QUERY + d for d in DOCS])
    args = EngineArgs(model=str(reranker_dir), **ENGINE)
    llm = AsyncLLM(LLMEngine(args.create_kiln_config()))
    with TestClient(build_app(llm, ServerSettings(served_model_names=["m"]))) as client:
        r = client.post("/rerank", json={"query": QUERY, "documents": DOCS, "model": "m"})
        assert r.status_code == 200, r.json()
        results = r.json()["results"]
        assert [x["index"] for x in results] == sorted(range(3), key=lambda i: -refs[i])
        for x in results:
            assert x["relevance_score"] == pytest.approx(refs[x["index"]], abs=ATOL)
            assert x["document"]["text"] == DOCS[x["index"]]
        r = client.post("/v1/score", json={"text_1": QUERY, "text_2": DOCS[2]})
        assert r.json()["data"][0]["score"] == pytest.approx(refs[2], abs=ATOL)
        paths = client.get("/openapi.json").json()["paths"]
        assert "/rerank" in paths and "/v1/chat/completions" not in paths


def test_gpt_neox_converted_reads_its_head_by_its_checkpoint_name(tiny_gpt_neox_dir,
                                                                   inprocess_core):
    """GPT-NeoX's LM head is embed_out in its checkpoint: a converted classifier dropped (or
    took rows of) lm_head by that name and failed as 'lm_head.weight matches no parameter'."""
    ids = [5, 9, 11]
    prompt = list(range(10, 30))
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt_neox_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0, -1, ids].softmax(-1)
    engine = {**ENGINE, "hf_overrides": {"method": "no_post_processing",
                                         "classifier_from_token": [f"w{i}" for i in ids]}}
    llm = LLM(model=str(tiny_gpt_neox_dir), convert="classify", **engine)
    try:
        got = llm.classify([{"prompt_token_ids": prompt}], use_tqdm=False)[0].outputs.probs
        torch.testing.assert_close(torch.tensor(got), ref, atol=ATOL, rtol=0)
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="checkpoint has no score.weight"):
        LLM(model=str(tiny_gpt_neox_dir), convert="classify", **ENGINE | {"hf_overrides": {}})
