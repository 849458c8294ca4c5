"""`kiln serve -tp 2` when a rank dies (SIGKILL): a stream in flight ends with an error event
naming the rank, then [DONE]; with none in flight /health turns 503 at once; either way the server
exits non-zero and every process it started (engine core, ranks) is gone. Waits are bounded."""
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from .test_server_e2e import NAME, running_server

SERVE_ARGS = ["-tp", "2", "--enforce-eager", "--dtype", "float32", "--max-model-len", "128",
              "--graceful-shutdown-timeout", "0", "--disable-access-log"]


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
    env = dict(os.environ, KILN_LOGGING_LEVEL="WARNING")
    with running_server(tiny_llama_dir, SERVE_ARGS, tmp_path / "serve.log", env) as (url, proc):
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
        _assert_all_exit(started)


def _health_turns_503(url: str, within_s: float) -> None:
    """/health answers 200 until the death is seen, then 503 until the server is gone."""
    killed = time.monotonic()
    while True:
        try:
            status = httpx.get(f"{url}/health", timeout=1).status_code
        except httpx.TransportError:
            status = None
        if status != 200:
            break
        assert time.monotonic() - killed < within_s, f"/health still 200 {within_s} s after"
        time.sleep(0.02)
    assert status in (503, None), status


def _assert_all_exit(pids: set[int]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(map(_alive, pids)):
        time.sleep(0.1)
    assert [p for p in pids if _alive(p)] == []


def test_a_rank_killed_while_idle_turns_health_503_and_the_server_exits(tiny_llama_dir,
                                                                        tmp_path):
    """No request is in flight, so no step finds the dead rank: the engine core watches the
    ranks between steps, and load balancers see the death on /health, not on a next request."""
    log = tmp_path / "serve.log"
    env = dict(os.environ, KILN_LOGGING_LEVEL="WARNING")
    with running_server(tiny_llama_dir, SERVE_ARGS, log, env) as (url, proc):
        started = _descendants(proc.pid)
        victim = _rank_pids(proc.pid)[-1]
        os.kill(victim, signal.SIGKILL)
        _health_turns_503(url, within_s=5)
        assert proc.wait(timeout=30) == 1
        _assert_all_exit(started)
    assert re.search(rf"the engine died \(worker rank \d \(pid {victim}\) was killed by "
                     r"SIGKILL between steps\)", log.read_text()), log.read_text()[-3000:]


# The core in its own process is also what `serve` runs: the idle test above sees that death
# (the same error, through the same dead_callbacks, in the log) and its exit; the kind crossing
# the process is test_core_process's test_a_kiln_error_from_the_core_is_raised_as_its_own_kind,
# and /health's 503 once the engine is dead is the in-process case's. Its own engine (two ranks)
# runs in the slow suite.
@pytest.mark.parametrize("core", [pytest.param("own process", marks=pytest.mark.slow),
                                  "in process"])
def test_health_is_503_once_an_idle_rank_died(tiny_llama_dir, core, monkeypatch):
    """The same death seen through the app without `serve` (which would exit): /health answers
    503, and the engine's error names the rank and how it died. With the core in this process
    nothing watched the ranks while idle: /health stayed 200 for good (helper-51)."""
    from fastapi.testclient import TestClient

    from kiln.engine.arg_utils import EngineArgs
    from kiln.engine.async_llm import AsyncLLM
    from kiln.entrypoints.openai.api_server import build_app
    from kiln.entrypoints.openai.server_settings import ServerSettings

    if core == "in process":
        monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "0")
    llm = AsyncLLM.from_engine_args(EngineArgs(
        model=str(tiny_llama_dir), tensor_parallel_size=2, enforce_eager=True, dtype="float32",
        max_model_len=128))
    deaths: list[BaseException] = []
    llm.dead_callbacks.append(deaths.append)
    with TestClient(build_app(llm, ServerSettings())) as client:
        assert client.get("/health").status_code == 200
        victim = _rank_pids(llm.core_pid)[-1]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 3
        while llm.is_running and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.get("/health").status_code == 503
    assert [type(e).__name__ for e in deaths] == ["WorkerFailedError"], deaths
    assert re.fullmatch(rf"worker rank \d \(pid {victim}\) was killed by SIGKILL between steps",
                        str(deaths[0])), deaths


def test_a_ray_actor_killed_while_idle_turns_health_503(tiny_llama_dir, tmp_path):
    """Ray's actors have no process sentinel for the core to wait on (they may be on another
    machine): an idle actor's death was found only by the next request. The core now pings them
    every second while idle."""
    log = tmp_path / "serve.log"
    env = dict(os.environ, KILN_LOGGING_LEVEL="WARNING", RAY_USAGE_STATS_ENABLED="0")
    args = [*SERVE_ARGS, "--distributed-executor-backend", "ray"]
    with running_server(tiny_llama_dir, args, log, env, new_session=True) as (url, proc):
        def actors() -> list[int]:
            found = []
            for pid in _descendants(proc.pid):
                try:
                    if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::RayRank"):
                        found.append(pid)
                except FileNotFoundError:
                    pass
            return sorted(found)

        assert len(actors()) == 2, actors()
        os.kill(actors()[-1], signal.SIGKILL)
        _health_turns_503(url, within_s=15)
        assert proc.wait(timeout=60) == 1
    assert re.search(r"the engine died \(worker rank \d \(Ray actor\) died between steps",
                     log.read_text()), log.read_text()[-3000:]
