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
