"""Fixtures for engine-front tests: the real stories260K tokenizer (no model needed)."""
from pathlib import Path

import pytest

STORIES = Path("/work/shared/models/stories260K")


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    if not (STORIES / "tokenizer.json").exists():
        pytest.skip("stories260K is not available")
    return STORIES


@pytest.fixture(scope="session")
def tokenizer(stories_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(stories_dir)
