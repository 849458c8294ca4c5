"""`kiln bench startup`'s own failures: a bad --timeout is refused, and a process that runs past
it is one error line (a subprocess traceback before)."""
import pytest

from kiln.entrypoints.cli.bench_startup import run
from kiln.entrypoints.cli.main import build_parser


def args_of(*argv):
    return build_parser().parse_args(["bench", "startup", *argv])


@pytest.mark.parametrize("timeout", ["0", "-1", "nan"])
def test_a_timeout_that_is_no_time_is_refused(timeout):
    with pytest.raises(ValueError, match="--timeout must be > 0 seconds"):
        run(args_of("--timeout", timeout))


def test_a_process_past_the_timeout_is_one_error_line(capsys):
    assert run(args_of("--timeout", "0.05", "--runs", "1")) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: `") and "ran past --timeout 0.05 s" in err
    assert "Traceback" not in err
