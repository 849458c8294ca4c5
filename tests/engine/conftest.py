"""Fixtures for engine-front tests: the real stories260K tokenizer (no model needed)."""
from pathlib import Path

import pytest

from checkpoints import STORIES_DIR


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    return STORIES_DIR


@pytest.fixture(scope="session")
def tokenizer(stories_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(stories_dir)


@pytest.fixture(params=["decode_stream", "python"])
def detokenizer_kind(request, monkeypatch):
    """Run a test on both detokenizers: tokenizers' DecodeStream (fast tokenizers) and the
    Python incremental one (slow tokenizers); `pytestmark = usefixtures(...)` in a module."""
    from kiln.engine import stream_detokenizer

    monkeypatch.setattr(stream_detokenizer, "USE_DECODE_STREAM", request.param == "decode_stream")
    return request.param


# The engine of the modules that drive a core process and leave it idle after each test
# (test_core_process.py, test_n_crosses_once.py, test_request_id_reuse.py): each core start
# costs seconds, so they share one.
SHARED_ENGINE = dict(enforce_eager=True, max_model_len=64, kv_cache_memory=0.01)


@pytest.fixture(scope="session")
def mp_llm(tiny_llama_dir):
    """`LLM` on the tiny Llama, its engine core in a process of its own."""
    from kiln.entrypoints.llm import LLM

    llm = LLM(model=str(tiny_llama_dir), **SHARED_ENGINE)
    yield llm
    llm.shutdown()

