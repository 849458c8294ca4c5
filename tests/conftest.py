"""Shared test fixtures: tiny random-weight HF checkpoints, built once per session; kiln log
capture."""
import logging
from pathlib import Path

import pytest

from checkpoints import STORIES_DIR, hf_greedy, make_tiny_checkpoint, random_prompts  # noqa: F401 (re-exported)

pytest_plugins = ["skip_gate"]


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama", tie=False)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", tie=True)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", tie=False)


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_phi3"), "phi3", tie=False)


@pytest.fixture(scope="session")
def tiny_granite_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_granite"), "granite", tie=True)


@pytest.fixture(scope="session")
def tiny_gemma_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_gemma"), "gemma", tie=True)


@pytest.fixture(scope="session")
def tiny_olmo2_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_olmo2"), "olmo2", tie=False)


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
