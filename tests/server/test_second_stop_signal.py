"""A second SIGINT / SIGTERM during the grace period: every request in flight ends in-band at
once, as aborted (finish_reason "abort" with the text so far, as vLLM's shutdown ends them: not
a crash's engine_dead error), and the server exits 0 with no traceback. uvicorn's
force quit on a second Ctrl-C cut streams mid-body, answered plain-text 500s, skipped the
engine's shutdown and logged tracebacks; a second SIGTERM did nothing."""
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.cli.serve import bind_socket
from kiln.entrypoints.openai.server_lifecycle import ServerSettings, serve
from kiln.executor.free_port import free_port

from .fake_engine import FakeEngine
from .test_group_sigterm_server import _wait_listening


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["int", "term"])
def test_a_second_stop_signal_ends_the_grace_period_in_band(sig, caplog):
    port = free_port()
    sock = bind_socket("127.0.0.1", port)
    url = f"http://127.0.0.1:{port}/v1/completions"
    streamed: list[str] = []
    whole: list[httpx.Response] = []
    started = threading.Event()
    ended_after: list[float] = []

    def stream():
        body = dict(prompt="x", max_tokens=2000, stream=True)
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    streamed.append(line)
                    started.set()

    def clients_then_signals():
        _wait_listening(port)
        readers = [threading.Thread(target=stream), threading.Thread(
            target=lambda: whole.append(httpx.post(url, json=dict(prompt="x", max_tokens=2000),
                                                   timeout=60)))]
        for t in readers:
            t.start()
        assert started.wait(30)
        os.kill(os.getpid(), sig)
        time.sleep(0.5)
        signalled = time.monotonic()
        os.kill(os.getpid(), sig)
        for t in readers:
            t.join(30)
        ended_after.append(time.monotonic() - signalled)

    thread = threading.Thread(target=clients_then_signals)
    thread.start()
    llm = AsyncLLM(FakeEngine(max_model_len=4096, step_delay=0.02))
    try:
        with caplog.at_level(logging.ERROR):
            code = serve(llm, ServerSettings(port=port, graceful_shutdown_timeout=60), sock)
    finally:
        sock.close()
        thread.join(60)
    assert code == 0 and ended_after[0] < 10, ended_after
    assert streamed[-1] == "data: [DONE]", streamed[-3:]
    last = json.loads(streamed[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "abort", last
    assert not any('"error"' in line for line in streamed)
    (r,) = whole
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "abort" and choice["text"], choice
    assert llm.engine.shut_down
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR], caplog.text


def test_a_third_stop_signal_exits_at_once_without_a_traceback(tmp_path):
    """uvicorn's force_exit on a third signal logged the lifespan's CancelledError traceback,
    skipped the engine's shutdown, and did nothing once that shutdown had begun (helper-72)."""
    port = free_port()
    script = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai.server_lifecycle import ServerSettings, serve
from server.fake_engine import FakeEngine
llm = AsyncLLM(FakeEngine(max_model_len=4096, step_delay=0.02))
sys.exit(serve(llm, ServerSettings(port={port}, graceful_shutdown_timeout=60)))
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    try:
        _wait_listening(port)
        url = f"http://127.0.0.1:{port}/v1/completions"
        chunks = []

        def stream():
            with contextlib.suppress(httpx.HTTPError):
                with httpx.stream("POST", url, json=dict(prompt="x", max_tokens=4000,
                                                         stream=True), timeout=60) as r:
                    for line in r.iter_lines():
                        chunks.append(line)

        reader = threading.Thread(target=stream)
        reader.start()
        deadline = time.monotonic() + 30
        while not chunks and time.monotonic() < deadline:
            time.sleep(0.02)
        for _ in range(3):
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.02)
        code = proc.wait(20)
        reader.join(30)
    finally:
        proc.kill()
        err = proc.stderr.read()
    assert code == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and "quitting now" in err, err
