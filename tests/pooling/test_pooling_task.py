"""The pooling task's decisions without a model: --convert / --task / the checkpoint's
architecture (vLLM's), the classifier's activation (HF's problem_type, a sentence-transformers
cross-encoder's activation_fn), and how score inputs pair."""
from types import SimpleNamespace

import pytest
import torch

from kiln.errors import ConfigError
from kiln.pooling.pooler_config import auto_runner, resolve_runner
from kiln.pooling.pooling_task import (
    activate,
    activation_kind,
    generate_fix,
    num_labels,
    pooling_task,
)
from kiln.pooling.scoring import score_lists

SEQ, CAUSAL = "Qwen3ForSequenceClassification", "Qwen3ForCausalLM"


def test_task_and_runner_from_flags_and_architecture():
    assert pooling_task("auto", None, SEQ) == pooling_task(None, "score", SEQ) == "classify"
    assert pooling_task("auto", None, CAUSAL) == pooling_task(None, "score", CAUSAL) == "embed"
    assert pooling_task("classify", None, CAUSAL) == pooling_task("auto", "classify",
                                                                  CAUSAL) == "classify"
    assert pooling_task("embed", None, SEQ) == pooling_task(None, "embed", SEQ) == "embed"
    assert pooling_task("none", None, SEQ) == "classify"
    with pytest.raises(ConfigError, match="--convert none: Qwen3ForCausalLM has no pooling"):
        pooling_task("none", None, CAUSAL)
    with pytest.raises(ConfigError, match="--convert 'reward' is not supported"):
        pooling_task("reward", None, CAUSAL)
    assert resolve_runner("auto", "classify") == resolve_runner(None, "score") == "pooling"
    assert resolve_runner(None, None, "classify") == "pooling"
    with pytest.raises(ConfigError, match="--convert classify makes a pooling model"):
        resolve_runner("generate", None, "classify")
    assert auto_runner(None, None, "generate", None, SEQ) == "pooling"
    assert auto_runner(None, None, "generate", None, CAUSAL) == "generate"
    with pytest.raises(ConfigError, match="is a classification model"):
        auto_runner("generate", None, "generate", None, SEQ)


def test_a_refusal_to_generate_names_what_can():
    """A classification checkpoint has no LM head (no flag makes it generate: the checkpoint
    picked the pooling runner by itself); a *ForCausalLM one generates on --runner generate,
    whatever (--convert classify, --task embed) picked pooling."""
    for offline in (True, False):
        assert generate_fix(SEQ, offline).startswith(f"{SEQ} is a classification model (a "
                                                     "score head, no LM head)")
    assert generate_fix(CAUSAL, True) == ('build it with runner="generate" (no convert / '
                                          'task) to generate')
    assert "--runner generate (no --convert / --task)" in generate_fix(CAUSAL, False)


def test_activation_as_vllms():
    cfg = SimpleNamespace
    logits = torch.tensor([[0.5, -1.0, 2.0]])
    assert activation_kind(cfg(id2label={"0": "a"}), "classify") == "classify"
    assert torch.equal(activate(logits, "classify"), logits.softmax(-1))
    assert torch.equal(activate(logits[:, :1], "classify"), logits[:, :1].sigmoid())
    multi = cfg(problem_type="multi_label_classification")
    assert torch.equal(activate(logits, activation_kind(multi, "classify")), logits.sigmoid())
    assert activation_kind(cfg(problem_type="regression"), "classify") == "identity"
    identity = cfg(sentence_transformers={"activation_fn": "torch.nn.modules.linear.Identity"})
    assert activation_kind(identity, "score") == "identity"
    assert activation_kind(identity, "classify") == "classify"  # the cross-encoder's only
    with pytest.raises(ConfigError, match="activation_fn 'os.system' is not supported"):
        activation_kind(cfg(sbert_ce_default_activation_function="os.system"), "score")
    assert num_labels(cfg(id2label={"0": "a"})) == 1 and num_labels(cfg()) == 2


def test_score_inputs_pair_1_1_1_n_or_n_n():
    assert score_lists("q", ["a", "b"]) == (["q"], ["a", "b"])
    assert score_lists(["q", "r"], ["a", "b"]) == (["q", "r"], ["a", "b"])
    with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 3"):
        score_lists(["q", "r"], ["a", "b", "c"])
    with pytest.raises(ValueError, match="text_1 is empty"):
        score_lists([], ["a"])
    # LLM.score(None, ...) was a bare TypeError from list(None)
    with pytest.raises(ValueError, match="text_1 must be a text or a list of texts, got NoneType"):
        score_lists(None, ["a"])
    with pytest.raises(ValueError, match="text_2 must be .* got int"):
        score_lists("q", 5)


def test_a_score_body_with_a_field_of_another_pair_is_refused_not_half_read():
    from kiln.entrypoints.openai.errors import OpenAIError
    from kiln.entrypoints.openai.serving_score import ScoreRequest

    assert ScoreRequest(queries="q", items=["a"]).sides()[0] == ("queries", "items")
    with pytest.raises(OpenAIError, match="queries is given beside text_1 / text_2") as err:
        ScoreRequest(text_1="q", text_2="a", queries=["x"]).sides()
    assert err.value.param == "queries"
