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
