"""Benchmarks' child processes: their JSON report read back with the environment given, and
`kiln bench startup`'s own failures: a bad --timeout is refused, a process that runs past it
is one error line (a subprocess traceback before), and so is a child refusing its arguments."""
import sys

import pytest

from kiln.benchmarks.child import run_json_child
from kiln.entrypoints.cli.bench_startup import run
from kiln.entrypoints.cli.main import build_parser


def args_of(*argv):
    return build_parser().parse_args(["bench", "startup", *argv])


@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "inf"])
def test_a_timeout_that_is_no_time_is_refused(timeout):
    """inf reached subprocess's select: an OverflowError traceback (helper-58)."""
    with pytest.raises(ValueError, match="--timeout must be > 0 seconds and finite"):
        run(args_of("--timeout", timeout))


@pytest.mark.parametrize("timeout", ["nan", "inf", "0"])
def test_bench_compile_refuses_the_same_timeouts(timeout):
    """`kiln bench compile --timeout nan` said "cannot convert float NaN to integer" and inf
    was an OverflowError traceback, after the cold start had begun (helper-58)."""
    from kiln.entrypoints.cli.bench_compile import run as run_compile

    args = build_parser().parse_args(["bench", "compile", "--timeout", timeout])
    with pytest.raises(ValueError, match="--timeout must be > 0 seconds and finite"):
        run_compile(args)


def test_a_process_past_the_timeout_is_one_error_line(capsys):
    assert run(args_of("--timeout", "0.05", "--runs", "1")) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: `") and "ran past --timeout 0.05 s" in err
    assert "Traceback" not in err


def test_a_child_runs_in_the_environment_given_and_its_last_json_line_is_the_report():
    code = "import os; print('{\"x\": 1}'); print('{\"env\": \"%s\"}' % os.environ['K'])"
    report, wall = run_json_child([sys.executable, "-c", code], timeout=60, env={"K": "v"})
    assert report == {"env": "v"} and wall > 0
    with pytest.raises(RuntimeError, match=r"failed \(exit 3\)"):
        run_json_child([sys.executable, "-c", "raise SystemExit(3)"], timeout=60)


def test_a_child_refusing_its_arguments_is_that_error_again():
    code = "import sys; print('error: prompt 0: prompt is empty', file=sys.stderr); sys.exit(2)"
    with pytest.raises(ValueError, match="^prompt 0: prompt is empty$"):
        run_json_child([sys.executable, "-c", code], timeout=60)
    # the startup child itself: a model that is not there is the user's to fix, not a traceback
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        run(args_of("--model", "/no/such/model", "--runs", "1"))
    assert "/no/such/model" in str(e.value) and "Traceback" not in str(e.value)
