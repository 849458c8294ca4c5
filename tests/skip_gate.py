"""Fails the run when a test skips for a reason not in tests/allowed_skips.txt.

On a clean clone every test must run; only CUDA-only tests may skip on a CPU machine.
"""
import re
from pathlib import Path

import pytest

ALLOWED = [re.compile(line) for line in
           (Path(__file__).parent / "allowed_skips.txt").read_text().splitlines()
           if line.strip() and not line.startswith("#")]

_refused: list[tuple[str, str]] = []


def skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = skip_reason(report)
        if not any(p.search(reason) for p in ALLOWED):
            _refused.append((report.nodeid, reason))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _refused and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    if _refused:
        terminalreporter.section("skips not in tests/allowed_skips.txt (these fail the run)")
        for nodeid, reason in _refused:
            terminalreporter.line(f"{nodeid}: {reason}")
