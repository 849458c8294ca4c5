"""Shared test fixtures: tiny random-weight HF checkpoints, built once per session; kiln log
capture."""
import logging
from pathlib import Path

import pytest

from checkpoints import STORIES_DIR, hf_greedy, make_tiny_checkpoint, make_tiny_classifier, random_prompts  # noqa: F401 (re-exported)

pytest_plugins = ["skip_gate"]


def _tiny_checkpoint_fixture(kind: str, tie: bool):
    """A session fixture: the directory of a tiny random-weight `kind` checkpoint."""
    @pytest.fixture(scope="session")
    def directory(tmp_path_factory) -> Path:
        return make_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny_{kind}"), kind, tie=tie)
    return directory


tiny_llama_dir = _tiny_checkpoint_fixture("llama", tie=False)
tiny_qwen2_dir = _tiny_checkpoint_fixture("qwen2", tie=True)
tiny_qwen3_dir = _tiny_checkpoint_fixture("qwen3", tie=False)
tiny_phi3_dir = _tiny_checkpoint_fixture("phi3", tie=False)
tiny_granite_dir = _tiny_checkpoint_fixture("granite", tie=True)
tiny_gemma_dir = _tiny_checkpoint_fixture("gemma", tie=True)
tiny_olmo2_dir = _tiny_checkpoint_fixture("olmo2", tie=False)
tiny_starcoder2_dir = _tiny_checkpoint_fixture("starcoder2", tie=True)
tiny_gpt_neox_dir = _tiny_checkpoint_fixture("gpt_neox", tie=False)
tiny_phi_dir = _tiny_checkpoint_fixture("phi", tie=False)
tiny_cohere_dir = _tiny_checkpoint_fixture("cohere", tie=True)
tiny_mistral_window_dir = _tiny_checkpoint_fixture("mistral_window", tie=False)
tiny_gemma2_dir = _tiny_checkpoint_fixture("gemma2", tie=True)
tiny_gemma3_dir = _tiny_checkpoint_fixture("gemma3", tie=True)
tiny_olmo3_dir = _tiny_checkpoint_fixture("olmo3", tie=False)
tiny_smollm3_dir = _tiny_checkpoint_fixture("smollm3", tie=True)
tiny_exaone4_dir = _tiny_checkpoint_fixture("exaone4", tie=False)
tiny_glm4_dir = _tiny_checkpoint_fixture("glm4", tie=False)
tiny_seed_oss_dir = _tiny_checkpoint_fixture("seed_oss", tie=False)
tiny_ernie4_5_dir = _tiny_checkpoint_fixture("ernie4_5", tie=True)
tiny_mixtral_dir = _tiny_checkpoint_fixture("mixtral", tie=False)
tiny_qwen2_moe_dir = _tiny_checkpoint_fixture("qwen2_moe", tie=False)
tiny_qwen3_moe_dir = _tiny_checkpoint_fixture("qwen3_moe", tie=False)
tiny_deepseek_v2_dir = _tiny_checkpoint_fixture("deepseek_v2", tie=False)
tiny_deepseek_v2_yarn_dir = _tiny_checkpoint_fixture("deepseek_v2_yarn", tie=False)
tiny_deepseek_v3_dir = _tiny_checkpoint_fixture("deepseek_v3", tie=False)


@pytest.fixture(scope="session")
def tiny_cls_qwen3_dir(tmp_path_factory):
    """Qwen3ForSequenceClassification, 3 labels with names."""
    return make_tiny_classifier(tmp_path_factory.mktemp("cls_qwen3"), "qwen3", 3,
                                id2label={0: "neg", 1: "neu", 2: "pos"})


@pytest.fixture(scope="session")
def tiny_ce_llama_dir(tmp_path_factory):
    """LlamaForSequenceClassification with one label: a cross-encoder."""
    return make_tiny_classifier(tmp_path_factory.mktemp("ce_llama"), "llama", 1, seed=1)


@pytest.fixture(scope="module")
def inprocess_core():
    """The engine core in the test's own process (KILN_ENABLE_V1_MULTIPROCESSING=0), for tests
    that count compiles and kernel calls or read the scheduler: `LLM` runs it in a child."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "0")
        yield


@pytest.fixture
def kiln_logs(caplog):
    """caplog for the `kiln` logger tree (it does not propagate to the root logger)."""
    logger = logging.getLogger("kiln")
    logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)
