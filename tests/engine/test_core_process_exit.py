"""The engine core in its own process, at its end: a core that dies, is killed or never says
goodbye, a dropped or interrupted front end, signals, and what each leaves behind."""
import os
import signal
import time

import pytest
from test_core_process import ENGINE, PROMPTS

from kiln.core.core_messages import input_codec
from kiln.engine.core_errors import EngineCoreDeadError
from kiln.entrypoints.llm import LLM
from kiln.sampling_params import SamplingParams


def _wait_gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # A zombie still answers kill(0): ask /proc for its state.
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] == "Z":
                    return True
        except (FileNotFoundError, ProcessLookupError):  # reaped at the open or the read
            return True
        time.sleep(0.05)
    return False


def test_a_killed_core_fails_the_next_call_at_once(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), **ENGINE)
    pid = llm.llm_engine.engine_core.pid
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3]},
                       SamplingParams(max_tokens=60, ignore_eos=True))
    engine.step()
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineCoreDeadError, match="killed by signal 9"):
        for _ in range(10_000):
            engine.step()
    assert time.monotonic() - start < 30  # a bound against hanging, not a timing claim
    with pytest.raises(EngineCoreDeadError):
        llm.generate(PROMPTS, SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()


def test_a_dropped_llm_ends_its_core_process(tiny_llama_dir):
    import gc

    llm = LLM(model=str(tiny_llama_dir), **ENGINE)
    pid = llm.llm_engine.engine_core.pid
    del llm
    gc.collect()
    assert _wait_gone(pid)


def test_a_killed_front_end_leaves_no_socket_directory(tiny_llama_dir):
    """kill -9 of the front end: nothing runs its cleanup, so the core, re-parented, removes the
    socket directory on its way out rather than leave it in /tmp."""
    import subprocess
    import sys

    code = ("import time; from kiln.entrypoints.llm import LLM; "
            f"llm = LLM(model={str(tiny_llama_dir)!r}, **{ENGINE!r}); "
            "core = llm.llm_engine.engine_core; "
            "print(core.pid, core._dir, flush=True); time.sleep(300)")
    front = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        pid, socket_dir = front.stdout.readline().split()
        assert os.path.isdir(socket_dir)
    finally:
        front.kill()
        front.wait()
    assert _wait_gone(int(pid))
    assert not os.path.exists(socket_dir)


def _reaped(pid: int, timeout: float = 30.0) -> bool:
    """Gone from the process table: not running and not a zombie left for us to reap."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{pid}"):
            return True
        time.sleep(0.05)
    return False


def test_shutdown_returns_at_the_cores_goodbye_and_the_process_is_reaped(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), **ENGINE)
    core = llm.llm_engine.engine_core
    pid, fds = core.pid, len(os.listdir("/proc/self/fd"))
    llm.generate(PROMPTS, SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()
    # The core wrote its last byte: shutdown did not wait for the kernel to free its memory.
    assert core._said_goodbye.is_set()
    assert _reaped(pid)  # the watcher thread reaps it: no zombie
    assert len(os.listdir("/proc/self/fd")) < fds  # its sockets, pidfd and pipe are closed


def test_a_core_that_never_says_goodbye_is_terminated(tiny_llama_dir, monkeypatch):
    from kiln.engine import core_client, core_proc_exit

    llm = LLM(model=str(tiny_llama_dir), **ENGINE)
    core = llm.llm_engine.engine_core
    os.kill(core.pid, signal.SIGSTOP)  # deaf to Shutdown: it can neither exit nor say goodbye
    monkeypatch.setattr(core_client, "_SHUTDOWN_WAIT_S", 0.5)
    # nor to the stop signal: its 5 s wait before the kill, shortened (the same path)
    wait_briefly = core_proc_exit.wait_briefly
    monkeypatch.setattr(core_proc_exit, "wait_briefly",
                        lambda proc, timeout: wait_briefly(proc, min(timeout, 0.5)))
    llm.shutdown()
    assert not core._said_goodbye.is_set() and core.proc.returncode is not None
    assert _reaped(core.pid)


def test_a_discarded_interpreter_leaves_no_descriptor_open():
    from kiln.engine.core_interpreter import CoreInterpreter

    fds = len(os.listdir("/proc/self/fd"))
    CoreInterpreter().discard()
    assert len(os.listdir("/proc/self/fd")) == fds


def test_a_send_to_a_core_that_closed_its_socket_ends_when_the_core_exits(tmp_path):
    """A core failing while idle closes its input socket before it exits: a request sent in
    between found no peer, and the blocking send waited forever (the server never exited)."""
    import subprocess
    import sys
    import threading

    import zmq

    from kiln.core.core_messages import AbortRequests
    from kiln.engine.core_client import CoreProcClient
    from kiln.engine.core_errors import EngineCoreDeadError

    client = CoreProcClient.__new__(CoreProcClient)  # its sending half, with a stand-in core
    ctx = zmq.Context()
    client._input = ctx.socket(zmq.PUSH)
    client._input.setsockopt(zmq.LINGER, 0)
    client._input.bind(f"ipc://{tmp_path}/input")  # nobody connects: the core closed its end
    client.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
    client.pid = client.proc.pid
    client._sentinel = os.pidfd_open(client.pid)
    client._send_poller = zmq.Poller()
    client._send_poller.register(client._input, zmq.POLLOUT)
    client._send_poller.register(client._sentinel, zmq.POLLIN)
    client._dead = None
    client._encoder, _ = input_codec()
    raised = []

    def send():
        try:
            client._send(AbortRequests(request_ids=["a"]))
        except EngineCoreDeadError as e:
            raised.append(e)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    sender.join(30)
    try:
        assert not sender.is_alive(), "the send still waits for a core that has exited"
        assert raised and "exited with code 0" in str(raised[0])
    finally:
        os.close(client._sentinel)
        ctx.destroy(linger=0)


@pytest.mark.parametrize("delay", [0.0, 0.3])
def test_the_core_interpreter_ignores_ctrl_c_while_it_imports(delay):
    """The terminal sends Ctrl-C to the whole process group; the core left its imports with a
    KeyboardInterrupt traceback. The front end decides what stops. At once: during Python's own
    start-up, before the core's first line (it died there); at 0.3 s: importing torch."""
    from kiln.engine.core_interpreter import CoreInterpreter

    interpreter = CoreInterpreter()
    try:
        time.sleep(delay)
        interpreter.proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        assert interpreter.proc.poll() is None
    finally:
        interpreter.discard()


def test_sigterm_to_kiln_generate_starting_up_leaves_nothing_behind(tiny_llama_dir, tmp_path):
    """`timeout` or a service manager signals the whole group while the engine starts: the front
    end died at once and left its socket directory in the temporary folder."""
    import subprocess
    import sys

    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "kiln.entrypoints.cli.main", "generate", "hello",
           "--model", str(tiny_llama_dir), "--enforce-eager", "--max-model-len", "64",
           "--max-tokens", "4"]
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:  # a file, not a pipe: nothing may block on a full pipe
        front = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("kiln-core-*")) and time.monotonic() < deadline:
        time.sleep(0.02)
    if not list(tmp_path.glob("kiln-core-*")):
        os.killpg(front.pid, signal.SIGKILL)
        pytest.fail(f"the engine never started: {log.read_text()}")
    os.killpg(front.pid, signal.SIGTERM)
    try:
        front.wait(timeout=60)
    finally:  # a hang must not outlive the test
        if front.poll() is None:
            os.killpg(front.pid, signal.SIGKILL)
    assert front.returncode != 0 and "Traceback" not in log.read_text(), log.read_text()
    # The orphaned core removes it once it notices (after its imports: slow on a loaded machine)
    deadline = time.monotonic() + 120
    while list(tmp_path.glob("kiln-core-*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not list(tmp_path.glob("kiln-core-*"))


def test_calls_after_the_cores_failure_say_the_engine_is_gone():
    """The failure's own kind reaches the call that read it; a later call (a request racing the
    death) raised that same error, which a server read as a bad request (ValueError: a 400 on
    the prompt) or its own bug (a 500)."""
    from kiln.core.core_messages import AbortRequests
    from kiln.engine.core_client import CoreProcClient
    from kiln.engine.core_errors import EngineCoreDeadError

    client = CoreProcClient.__new__(CoreProcClient)
    client._encoder, _ = input_codec()
    failure = ValueError("CUDA error: an illegal memory access")  # as rebuild_error builds it
    client._dead = failure
    with pytest.raises(EngineCoreDeadError, match="engine core failed: CUDA error") as e:
        client._send(AbortRequests(request_ids=["a"]))
    assert e.value.__cause__ is failure


def test_the_core_removes_its_private_inductor_cache(tiny_llama_dir, tmp_path, monkeypatch):
    """With Kiln's compile cache off, the core compiles into an Inductor cache of its own
    (compilation/cache.py); it ends in os._exit, which skips atexit, so it removes the directory
    itself rather than leave one in the temporary directory per start."""
    monkeypatch.setenv("KILN_DISABLE_COMPILE_CACHE", "1")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the core's tempfile directory
    # The eager backend opens the same private cache (backend.py's _open_cache) without a cold
    # Inductor compile; Inductor compiling into it is tests/compilation/inductor_stack's
    # test_disabled_cache_reuses_nothing_from_inductor_cache.
    llm = LLM(model=str(tiny_llama_dir), max_model_len=64, kv_cache_memory=0.01,
              compilation_config={"mode": 3, "backend": "eager"})
    assert list(tmp_path.glob("kiln_inductor_*"))  # made for the compile
    llm.generate(PROMPTS, SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()
    assert not list(tmp_path.glob("kiln_inductor_*"))


def test_a_forked_childs_exit_leaves_the_parents_engine_alone(tiny_llama_dir):
    """The exit hooks ran in a forked child too: its plain exit stopped the parent's core and
    then hung for good on the Popen's wait lock, which the parent's watcher held at the fork."""
    import subprocess
    import sys

    code = f"""
import os, sys, time
from kiln.entrypoints.llm import LLM
from kiln.sampling_params import SamplingParams
llm = LLM(model={str(tiny_llama_dir)!r}, **{ENGINE!r})
pid = os.fork()
if pid == 0:
    # the parent's engine: generate and reset_prefix_cache refused at once (they hung), and
    # shutdown does nothing at once (it waited 10 s on a goodbye that never left)
    for call in (lambda: llm.generate({{"prompt_token_ids": [1, 2]}}, SamplingParams(max_tokens=1)),
                 llm.reset_prefix_cache):
        try:
            call()
            sys.exit(4)
        except RuntimeError as e:
            if "forked process" not in str(e):
                sys.exit(3)
    start = time.monotonic()
    llm.shutdown()
    sys.exit(0 if time.monotonic() - start < 2 else 5)  # a plain exit: the exit hooks run
deadline = time.monotonic() + 30
while (status := os.waitpid(pid, os.WNOHANG)) == (0, 0):
    assert time.monotonic() < deadline, "the forked child hangs"
    time.sleep(0.05)
assert os.waitstatus_to_exitcode(status[1]) == 0, status
out = llm.generate({{"prompt_token_ids": [1, 2, 3]}}, SamplingParams(max_tokens=2))
print("tokens", len(out[0].outputs[0].token_ids), flush=True)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert run.returncode == 0 and "tokens 2" in run.stdout, run.stderr[-2000:]


def test_an_interrupt_before_the_core_knows_its_directory_removes_it(tmp_path, monkeypatch):
    """SIGTERM lands between the socket directory's creation and the core's start (the test
    above caught it there now and then): the directory was left in the temporary folder, since
    no core knew of it to remove it."""
    import tempfile

    from kiln.engine import core_client

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(core_client.zmq, "Context", interrupted)
    with pytest.raises(KeyboardInterrupt):
        core_client.CoreProcClient(None, object)
    assert not list(tmp_path.glob("kiln-core-*"))
