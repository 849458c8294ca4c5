"""`kiln serve` with its engine core in another process: a stream keeps producing tokens while the
front end tokenizes huge bodies, and a killed core ends every stream with an error and the
server with a non-zero exit (bounded waits, never a hang)."""
import asyncio
import json
import os
import re
import signal
import threading
from pathlib import Path

import httpx
import pytest

from kiln.benchmarks.stall_probe import LoadSpec, run_probe

from .test_server_e2e import STORIES_DIR, running_server

NAME = "stories"


@pytest.fixture(scope="module")
def core_server(tmp_path_factory):
    args = ["--enforce-eager", "--max-model-len", "512", "--kv-cache-memory", "0.05",
            "--disable-access-log", "--max-request-body-bytes", "2000000",
            "--graceful-shutdown-timeout", "0"]
    log = tmp_path_factory.mktemp("core_server_log") / "serve.log"
    with running_server(STORIES_DIR, args, log, dict(os.environ, KILN_LOGGING_LEVEL="WARNING")) \
            as (url, proc):
        yield url, proc, log


def children_running(server_pid: int, module: str) -> list[int]:
    """The server's children running `python -m module`."""
    children = set()
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        children.update(int(p) for p in (task / "children").read_text().split())
    return [pid for pid in children
            if module.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]


def core_pid(server_pid: int) -> int:
    """The server's engine core (its other child may be the bulk tokenizer)."""
    cores = children_running(server_pid, "kiln.core.core_process")
    assert len(cores) == 1, cores
    return cores[0]


def test_one_banner_says_what_is_served(core_server):
    url, _, log = core_server
    lines = [x for x in log.read_text().splitlines() if x.startswith("kiln serve: ")]
    assert len(lines) == 1, lines
    port = url.rsplit(":", 1)[1]
    for part in (f"model {NAME}", "dtype float32", "compile mode 0", "blocks x 16 tokens",
                 f"http://127.0.0.1:{port}", "API key off"):
        assert part in lines[0], (part, lines[0])
    # A served core leaves a core to the front end (tests/engine/test_front_end_cores.py).
    threads = int(re.search(r"engine threads (\d+)", lines[0]).group(1))
    cores = len(os.sched_getaffinity(0))
    assert threads >= 1 and (threads < cores or cores == 1), lines[0]


def test_a_stream_keeps_going_while_the_front_end_tokenizes_huge_bodies(core_server):
    url, _, _ = core_server
    # Smaller than the benchmark's load, same kinds: big bodies, idle and churning connections.
    load = LoadSpec(tokenize_bytes=1_500_000, prompt_400_bytes=1_500_000, idle_connections=50,
                    churn_clients=10, id_prompt_400_clients=1)
    report = asyncio.run(run_probe(url, duration=3.0, load=load, max_tokens=200, rounds=2))
    # two rounds on one stream, each load process ready before its idle phase; the report is
    # the median round's
    assert len(report["rounds"]) == 2 and report["median_round"] in (0, 1), report
    assert report["max_gap_ratio"] == report["rounds"][report["median_round"]]["max_gap_ratio"]
    assert report["big_requests_done"] >= 2, report
    assert report["idle_connections_held"] == 50, report
    # their hang-up, all at once, is timed apart from the load it ends
    assert report["teardown"]["connections"] == 50 and report["teardown"]["max_gap_ms"] > 0
    # The report says at what OS niceness the load ran (LoadSpec.niceness added to ours).
    assert report["load_niceness"] == min(19, os.nice(0) + LoadSpec().niceness), report
    # One thread for tokenizing and stepping froze the stream for each big request (a token or
    # two at its edges, while the body uploads); now tokens arrive while they are in flight.
    # A structural floor, low enough for a machine loaded many times over (measured there: 14).
    assert report["tokens_during_big_requests"] >= 5, report


def test_a_huge_text_is_tokenized_in_a_child_with_the_same_ids(core_server):
    from transformers import AutoTokenizer

    url, proc, _ = core_server
    text = "Once upon a time, a little dog ran to the park.\n" * 3000  # past BULK_CHARS
    r = httpx.post(f"{url}/tokenize", json=dict(prompt=text), timeout=60)
    assert r.status_code == 200, r.text
    expected = AutoTokenizer.from_pretrained(STORIES_DIR)(text).input_ids
    assert r.json()["tokens"] == expected and r.json()["count"] == len(expected)
    assert len(children_running(proc.pid, "kiln.engine.bulk_tokenizer")) == 1


@pytest.mark.parametrize("fields,param", [
    ('"prompt": "ab\\ud800c"', "prompt"), ('"prompt": ["ok", "\\udfff"]', "prompt[1]"),
    # these failed on their way to the core process: a 400 that named the prompt
    ('"prompt": "x", "stop": "\\ud800"', "stop"),
    ('"prompt": "x", "request_id": "\\ud800"', "request_id")])
def test_a_lone_surrogate_is_a_400_naming_its_field(core_server, fields, param):
    url, _, _ = core_server
    r = httpx.post(f"{url}/v1/completions", timeout=30,
                   content=f'{{{fields}, "max_tokens": 2}}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and "surrogate" in r.text


def test_a_killed_core_ends_streams_with_an_error_and_the_server_exits_non_zero(core_server):
    url, proc, log = core_server
    lines: list[str] = []
    first_token = threading.Event()
    failure = {}

    def stream():
        body = dict(model=NAME, prompt="Once upon a time", max_tokens=480, ignore_eos=True,
                    stream=True)
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        first_token.set()
        except httpx.HTTPError as e:  # a cut connection is an error too, not a hang
            failure["error"] = e

    t = threading.Thread(target=stream)
    t.start()
    assert first_token.wait(60)
    os.kill(core_pid(proc.pid), signal.SIGKILL)
    t.join(60)
    assert not t.is_alive(), "the stream hung after its core died"
    assert proc.wait(timeout=60) == 1, log.read_text()[-3000:]
    if "error" not in failure:  # ended in-band: an error event, then [DONE]
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert "error" in events[-1], lines[-3:]
        assert "engine core process" in events[-1]["error"]["message"]
        assert lines[-1] == "data: [DONE]"
    assert "engine core process" in log.read_text()
    with pytest.raises(httpx.ConnectError):  # the server is gone, not half-alive
        httpx.get(f"{url}/health", timeout=5)
