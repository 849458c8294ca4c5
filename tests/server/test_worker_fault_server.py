"""`kiln serve -tp 2` when a rank dies mid-stream (SIGKILL): the stream in flight ends with an
error event naming the rank, then [DONE]; the server exits non-zero and every process it started
(engine core, ranks) is gone. Every wait is bounded, so a hang fails the test."""
import os
import re
import signal
import time
from pathlib import Path

import httpx

from .test_server_e2e import NAME, running_server


def _children(pid: int) -> set[int]:
    out: set[int] = set()
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            out.update(int(p) for p in (task / "children").read_text().split())
    except FileNotFoundError:  # exited meanwhile
        pass
    return out


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        kids = _children(todo.pop())
        found |= kids
        todo += kids
    return found


def _rank_pids(server_pid: int) -> list[int]:
    def is_rank(pid: int) -> bool:
        try:
            return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ranks = sorted(p for p in _descendants(server_pid) if is_rank(p))
        if len(ranks) == 2:
            return ranks
        time.sleep(0.2)
    raise AssertionError(f"expected 2 rank processes under the server, found {ranks}")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_killed_rank_ends_the_stream_with_an_error_naming_it(tiny_llama_dir, tmp_path):
    args = ["-tp", "2", "--enforce-eager", "--dtype", "float32", "--max-model-len", "128",
            "--graceful-shutdown-timeout", "0", "--disable-access-log"]
    env = dict(os.environ, KILN_LOGGING_LEVEL="WARNING")
    with running_server(tiny_llama_dir, args, tmp_path / "serve.log", env) as (url, proc):
        started = _descendants(proc.pid)
        victim = _rank_pids(proc.pid)[-1]
        events: list[str] = []
        body = {"model": NAME, "prompt": "w1 w2 w3", "max_tokens": 120, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 2:  # tokens are flowing: the request is in flight
                    os.kill(victim, signal.SIGKILL)
        assert events[-1] == "data: [DONE]", events[-3:]
        (error,) = [e for e in events if '"error"' in e]
        assert re.search(rf"worker rank \d \(pid {victim}\) was killed by SIGKILL", error), error
        try:  # a request after the failure: an OpenAI-style error, or the server already gone
            after = httpx.post(f"{url}/v1/completions", timeout=30,
                               json={"model": NAME, "prompt": "w1", "max_tokens": 2})
            assert after.status_code >= 500 and after.json()["error"]["message"], after.text
        except httpx.TransportError:
            pass
        assert proc.wait(timeout=60) != 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(map(_alive, started)):
            time.sleep(0.1)
        assert [p for p in started if _alive(p)] == []
