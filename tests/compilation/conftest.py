"""Shared fixtures for the compile-stack tests: warm-up phase reset, kiln log capture."""
import logging

import pytest

from kiln.compilation import phase


@pytest.fixture(autouse=True)
def _warmup_phase():
    phase.reset_warmup()
    yield
    phase.reset_warmup()


@pytest.fixture
def kiln_logs(caplog):
    """caplog for the `kiln` logger tree (it does not propagate to the root logger)."""
    logger = logging.getLogger("kiln")
    logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)
