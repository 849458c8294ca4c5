"""A benchmark's child process: run it, and read the JSON report it prints last.

A child refusing its arguments (exit 2 after one "error: ..." line, as the `kiln` command does)
is that ValueError again; other failures and a run past the benchmark's --timeout are
RuntimeErrors naming the command, which the benchmark's command prints as one "error: ..." line
(print_report).
"""
import json
import shlex
import subprocess
import sys
import time

from kiln.entrypoints.cli.main import USAGE_ERROR_EXIT


def check_timeout(timeout: float | None) -> None:
    """A benchmark's --timeout: None or a finite number of seconds > 0 (inf reached
    subprocess's select as an OverflowError traceback, nan a bare "cannot convert float NaN")."""
    if timeout is not None and not 0 < timeout < float("inf"):
        raise ValueError(f"--timeout must be > 0 seconds and finite (leave it out for no "
                         f"limit), got {timeout}")


def run_json_child(argv: list[str], *, timeout: float | None, env: dict | None = None
                   ) -> tuple[dict, float]:
    """(the last JSON object line of its stdout, wall seconds)."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"`{shlex.join(argv)}` ran past --timeout {timeout} s") from None
    wall = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    if proc.returncode == USAGE_ERROR_EXIT and last.startswith("error: "):
        raise ValueError(last.removeprefix("error: "))  # the arguments: the user's to fix
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"`{shlex.join(argv)}` failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1]), wall


def print_report(make_report) -> int:
    """`kiln bench compile/startup`'s end: make_report()'s report printed as one JSON line (exit
    0), or the RuntimeError of a child that failed or ran past --timeout as one "error: ..."
    line (exit 1)."""
    try:
        report = make_report()
    except RuntimeError as e:  # a start-up process failed or ran past --timeout: say which
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report), flush=True)
    return 0
