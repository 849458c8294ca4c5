"""`kiln serve -dp 2`: concurrent streams land on both replicas (per-engine metrics), a cancelled
stream frees its replica for the next request, and a killed replica fails every stream with an
error naming it, /health goes unhealthy and the server exits non-zero."""
import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

from .test_core_process_server import children_running
from .test_server_e2e import STORIES_DIR, running_server

NAME = "stories"


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory):
    args = ["--enforce-eager", "-dp", "2", "--max-model-len", "256", "--kv-cache-memory", "0.02",
            "--disable-access-log", "--graceful-shutdown-timeout", "0"]
    log = tmp_path_factory.mktemp("dp_server_log") / "serve.log"
    with running_server(STORIES_DIR, args, log, dict(os.environ, KILN_LOGGING_LEVEL="WARNING")) \
            as (url, proc):
        yield url, proc, log


def running_per_engine(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(
        r'kiln:num_requests_running\{engine="(\d+)",model_name="stories"\} (\S+)', text)}


def wait_for_running(url: str, expected: dict[str, float]) -> dict[str, float]:
    """Scrape until the per-engine running counts are `expected` (bounded: 30 s)."""
    deadline = time.monotonic() + 30
    while (seen := running_per_engine(url)) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return seen


class Stream(threading.Thread):
    """A long streamed completion; `stop` hangs up, `lines` keeps what arrived."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.lines, self.error = url, [], None
        self.started, self.stop = threading.Event(), threading.Event()
        self.start()

    def run(self):
        body = dict(model=NAME, prompt="Once upon a time", max_tokens=240, ignore_eos=True,
                    stream=True)
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.started.set()
                    if self.stop.is_set():
                        return
        except httpx.HTTPError as e:  # a cut connection is an error too, not a hang
            self.error = e
        finally:
            self.started.set()


def test_streams_spread_over_replicas_and_a_cancelled_one_frees_its_replica(dp_server):
    url, _, log = dp_server
    assert "in each of 2 data-parallel replicas" in log.read_text()
    a = Stream(url)  # to replica 0 (all idle: the first)
    assert a.started.wait(60)
    b = Stream(url)  # to replica 1 (0 has one running)
    assert b.started.wait(60)
    assert wait_for_running(url, {"0": 1.0, "1": 1.0}) == {"0": 1.0, "1": 1.0}
    a.stop.set()  # the client hangs up: replica 0's request is aborted
    a.join(30)
    assert wait_for_running(url, {"0": 0.0, "1": 1.0}) == {"0": 0.0, "1": 1.0}
    # the next request goes to the freed replica, not behind b
    c = Stream(url)
    assert c.started.wait(60)
    assert wait_for_running(url, {"0": 1.0, "1": 1.0}) == {"0": 1.0, "1": 1.0}
    for s in (b, c):
        s.stop.set()
        s.join(30)
    assert wait_for_running(url, {"0": 0.0, "1": 0.0}) == {"0": 0.0, "1": 0.0}
    # each request's metrics under its replica (vLLM's engine label): a and c on 0, b on 1
    ttft = {m[1]: float(m[2]) for m in re.finditer(
        r'kiln:time_to_first_token_seconds_count\{engine="(\d+)",model_name="stories"\} '
        r'(\S+)', httpx.get(f"{url}/metrics").text)}
    assert ttft == {"0": 2.0, "1": 1.0}, ttft


def test_a_killed_replica_fails_requests_by_name_and_the_server_goes_down(dp_server):
    url, proc, log = dp_server
    cores = children_running(proc.pid, "kiln.core.core_process")
    assert len(cores) == 2, cores
    streams = [Stream(url), Stream(url)]
    assert all(s.started.wait(60) for s in streams)
    os.kill(cores[1], signal.SIGKILL)
    for s in streams:
        s.join(60)
        assert not s.is_alive(), "a stream hung after a replica died"
        if s.error is None:  # ended in-band: an error event naming the replica, then [DONE]
            event = json.loads(s.lines[-2][6:])
            assert re.search(r"data-parallel engine \d of 2 \(pid \d+\) died: the engine core "
                             r"process \(pid \d+\) was killed by signal 9",
                             event["error"]["message"]), event
            assert s.lines[-1] == "data: [DONE]"
    try:
        assert httpx.get(f"{url}/health", timeout=5).status_code == 503
    except httpx.TransportError:
        pass  # going or gone (refused, or hung up unanswered): unhealthy too
    assert proc.wait(timeout=60) == 1, log.read_text()[-3000:]
    assert "data-parallel engine" in log.read_text()
    for pid in cores:  # the other replica ended with the server
        assert not os.path.exists(f"/proc/{pid}") or \
            open(f"/proc/{pid}/stat").read().split()[2] == "Z"
