"""Shared fixtures for the compile-stack tests: kiln log capture."""
import logging

import pytest


@pytest.fixture
def kiln_logs(caplog):
    """caplog for the `kiln` logger tree (it does not propagate to the root logger)."""
    logger = logging.getLogger("kiln")
    logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)
