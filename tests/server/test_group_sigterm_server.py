"""A service manager's stop: SIGTERM to every process of `kiln serve` (systemd's default,
`timeout`, `kill -- -PGID`). The engine core, its ranks and the bulk tokenizer leave it to the
front end, which finishes the streams in flight within its grace period, then stops them; the
core used to exit at once and cut every stream."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from kiln import process_signals
from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.cli.serve import bind_socket
from kiln.entrypoints.openai.server_lifecycle import ServerSettings, serve
from kiln.executor.free_port import free_port

from .fake_engine import FakeEngine
from .test_core_process_server import children_running
from .test_server_e2e import NAME, STORIES_DIR, running_server

# Long enough that the signal lands mid-stream (checked below: a core that obeyed the group's
# SIGTERM cut the stream within a step or two), short enough that tp2's slow steps finish well
# inside the grace period on a loaded machine (400 took 16 s of the suite's time at tp2).
MAX_TOKENS = 100


def _family(pid: int) -> set[int]:
    """pid and all its descendants."""
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        found.add(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo.extend(int(c) for c in (task / "children").read_text().split())
            except OSError:
                pass  # exited meanwhile
    return found


@pytest.mark.parametrize("extra", [[], ["--tensor-parallel-size", "2"]], ids=["core", "tp2"])
def test_group_sigterm_lets_streams_in_flight_finish(tmp_path, extra):
    args = ["--enforce-eager", "--max-model-len", "512", "--kv-cache-memory", "0.05",
            "--disable-access-log", "--graceful-shutdown-timeout", "60", *extra]
    log = tmp_path / "serve.log"
    env = dict(os.environ, KILN_LOGGING_LEVEL="WARNING")
    with running_server(STORIES_DIR, args, log, env, new_session=True) as (url, proc):
        core = children_running(proc.pid, "kiln.core.core_process")
        assert len(core) == 1, core
        family = _family(proc.pid)
        assert len(family) >= (4 if extra else 2), family  # front end, core (ranks, tokenizer)
        lines: list[str] = []
        started = threading.Event()

        def stream():
            body = dict(model=NAME, prompt="x", max_tokens=MAX_TOKENS, ignore_eos=True,
                        stream=True, stream_options={"include_usage": True})
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(60), log.read_text()
        os.killpg(proc.pid, signal.SIGTERM)
        signalled_at = len(lines)
        assert proc.wait(timeout=90) == 0, log.read_text()
        reader.join(30)
        text = log.read_text()
        assert signalled_at < MAX_TOKENS // 2, "the stream ended before the signal: no test"
        assert lines[-1] == "data: [DONE]", lines[-3:]
        usage = json.loads(lines[-2][len("data: "):])["usage"]
        assert usage["completion_tokens"] == MAX_TOKENS, (usage, text)
        assert "Traceback" not in text, text
        deadline = time.monotonic() + 30  # nothing of the server outlives it
        while any(Path(f"/proc/{p}").exists() for p in family) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in family if Path(f"/proc/{p}").exists()]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_sigterm_whose_systemexit_was_swallowed_is_still_kept(monkeypatch):
    """A SIGTERM landing in a __del__ during start-up: Python prints "Exception ignored" and
    drops the SystemExit, and `kiln serve` went on to serve forever (helper-23)."""
    monkeypatch.setattr(process_signals, "_stopped_by", None)

    class Collected:
        def __del__(self):
            process_signals.terminate(signal.SIGTERM, None)

    Collected()  # its SystemExit is swallowed right here
    assert process_signals.stopped_by() == signal.SIGTERM


def test_a_stop_signal_before_serving_stops_the_server_at_once():
    port = free_port()
    sock = bind_socket("127.0.0.1", port)
    started = time.monotonic()
    try:
        code = serve(AsyncLLM(FakeEngine()), ServerSettings(port=port), sock,
                     stop_signal=lambda: signal.SIGTERM)
    finally:
        sock.close()
    assert code == 128 + signal.SIGTERM and time.monotonic() - started < 10


def test_a_body_still_uploading_at_the_end_of_the_grace_period_gets_a_503():
    """Its handler waits in the body reader, out of the engine's reach: uvicorn cancelled it
    after the grace period and the report time, answering a plain-text 500 (helper-38)."""
    port = free_port()
    sock = bind_socket("127.0.0.1", port)
    reply = []

    def upload_then_stop():
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 50\r\n\r\n{")
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGTERM)
            started = time.monotonic()
            data = b""
            while chunk := conn.recv(65536):
                data += chunk
            reply.append((data, time.monotonic() - started))

    # serve() runs on this (the main) thread, whose SIGTERM handler it installs.
    thread = threading.Thread(target=lambda: (_wait_listening(port), upload_then_stop()))
    thread.start()
    try:
        code = serve(AsyncLLM(FakeEngine()), ServerSettings(port=port, request_body_timeout=60,
                                                            graceful_shutdown_timeout=0.5),
                     sock)
    finally:
        sock.close()
        thread.join(30)
    (data, waited), = reply
    assert data.startswith(b"HTTP/1.1 503"), data[:300]
    assert b'"server_shutting_down"' in data and b"--graceful-shutdown-timeout" in data
    assert waited < 4 and code == 0


def _wait_listening(port: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)


def test_both_stop_signals_at_once_leave_no_traceback():
    """The group's SIGTERM and the front end's STOP_SIGNAL pending together (the core was in a
    long C call): the first handler set SIGTERM to SIG_IGN with one still pending, and CPython
    raised "Signal 15 ignored due to race condition" on the way out (helper-23)."""
    child = """
import os, signal, time
from kiln.process_signals import STOP_SIGNAL, exit_once, leave_group_signals_to_parent
leave_group_signals_to_parent("engine core")
signal.signal(STOP_SIGNAL, exit_once)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, STOP_SIGNAL})  # a long C call
os.kill(os.getpid(), signal.SIGTERM)
os.kill(os.getpid(), STOP_SIGNAL)
try:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, STOP_SIGNAL})
    time.sleep(0.1)
except SystemExit:
    pass
time.sleep(0.1)  # the way out
print("out")
"""
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout == "out\n" and "Traceback" not in done.stderr, done.stderr


def test_an_orphaned_core_stopped_by_sigterm_removes_its_sockets(tmp_path):
    """The front end killed (OOM), then the group's SIGTERM within the core's 0.5 s watch: the
    core left by the signal's way out, which never removed the sockets (helper-23)."""
    env = dict(os.environ, KILN_LOGGING_LEVEL="WARNING", TMPDIR=str(tmp_path))
    args = ["--enforce-eager", "--max-model-len", "128", "--kv-cache-memory", "0.05"]
    with running_server(STORIES_DIR, args, tmp_path / "serve.log", env,
                        new_session=True) as (_, proc):
        family = _family(proc.pid)
        assert list(tmp_path.glob("kiln-core-*"))
        proc.kill()
        proc.wait()  # gone: the core is an orphan from now on
        os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while any(Path(f"/proc/{p}").exists() for p in family) and time.monotonic() < deadline:
            time.sleep(0.1)
    assert not list(tmp_path.glob("kiln-core-*"))


def test_a_child_says_it_ignored_sigterm_only_while_its_parent_lives(tmp_path):
    """A script under `timeout -s TERM`: the core logged "SIGTERM ignored" although its parent
    was dying of the same signal. The warning now waits for the parent to outlive it."""
    child = """
import os, signal, sys, time
from kiln import process_signals
process_signals._WARN_AFTER_S = 0.3
process_signals.leave_group_signals_to_parent("engine core")
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(1.0)
print("alive")
"""
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout == "alive\n" and "engine core (pid" in done.stderr, done.stderr
    assert "SIGTERM ignored" in done.stderr
    # The same SIGTERM ending the parent: the child, orphaned before the warning's time, is
    # silent (its stderr is a file, which outlives the parent).
    log = tmp_path / "child.log"
    orphan = """
import sys, time
from kiln import process_signals
process_signals._WARN_AFTER_S = 0.3
process_signals.leave_group_signals_to_parent("engine core")
print("ready", file=sys.stderr, flush=True)
time.sleep(1.5)
print("alive", file=sys.stderr, flush=True)
"""
    parent = f"""
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", {orphan!r}], stderr=open({str(log)!r}, "w"))
while "ready" not in open({str(log)!r}).read():
    time.sleep(0.02)
os.kill(child.pid, signal.SIGTERM)  # and exit at once, as a parent dying of the same signal
print(child.pid)
"""
    pid = int(subprocess.run([sys.executable, "-c", parent], timeout=60, check=True,
                             capture_output=True, text=True).stdout)
    # Under load the child may run its handler only once orphaned, and then exits at once (an
    # orphan's SIGTERM is obeyed): either way it must not warn.
    deadline = time.monotonic() + 30
    while "alive" not in log.read_text() and time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    assert "SIGTERM ignored" not in log.read_text(), log.read_text()


def test_commands_unwind_once_their_engine_is_built_after_a_lost_stop(monkeypatch):
    """`kiln chat` would wait for input forever, `kiln generate` work on, after a SIGTERM whose
    SystemExit was swallowed while the engine started."""
    monkeypatch.setattr(process_signals, "_stopped_by", None)
    process_signals.exit_if_stopped()  # nothing came: nothing happens
    monkeypatch.setattr(process_signals, "_stopped_by", signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        process_signals.exit_if_stopped()
    assert e.value.code == 143
