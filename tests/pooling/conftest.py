"""Tiny random classifier checkpoints (HF *ForSequenceClassification), built once per session."""
import pytest

from checkpoints import make_tiny_classifier


@pytest.fixture(scope="session")
def tiny_cls_qwen3_dir(tmp_path_factory):
    """Qwen3ForSequenceClassification, 3 labels with names."""
    return make_tiny_classifier(tmp_path_factory.mktemp("cls_qwen3"), "qwen3", 3,
                                id2label={0: "neg", 1: "neu", 2: "pos"})


@pytest.fixture(scope="session")
def tiny_ce_llama_dir(tmp_path_factory):
    """LlamaForSequenceClassification with one label: a cross-encoder."""
    return make_tiny_classifier(tmp_path_factory.mktemp("ce_llama"), "llama", 1, seed=1)
