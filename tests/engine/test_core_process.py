"""The engine core in its own process: the wire format, parity with the in-process core, start-up
errors of the same kind, and a core that dies or is dropped."""
import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest

from kiln.core.core_messages import decode_params, encode_params, from_wire, input_codec, to_wire
from kiln.core.request import Request
from kiln.engine.core_errors import EngineCoreDeadError
from kiln.entrypoints.llm import LLM
from kiln.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

ENGINE = dict(enforce_eager=True, max_model_len=64, kv_cache_memory=0.01)
PROMPTS = [{"prompt_token_ids": [1, 2, 3, 4]}, {"prompt_token_ids": [9, 8, 7]}]


def test_sampling_params_cross_field_by_field():
    params = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=-3,
                            presence_penalty=0.5, frequency_penalty=-0.5,
                            repetition_penalty=1.2, stop=["x", "yz"], stop_token_ids=[4],
                            ignore_eos=True, max_tokens=9, min_tokens=2, logprobs=3,
                            prompt_logprobs=1, skip_special_tokens=False,
                            include_stop_str_in_output=True, detokenize=True,
                            logit_bias={5: -2.5, 7: 1.0}, allowed_token_ids=[4, 5, 7],
                            bad_words=["ab"], truncate_prompt_tokens=3,
                            structured_outputs=StructuredOutputsParams(
                                json={"type": "object", "properties": {"a": {"type": "integer"}}},
                                reasoning_end="</think>"),
                            output_kind=RequestOutputKind.DELTA)
    params.all_stop_token_ids = {4, 2}  # the engine front adds eos: verify() would reset it
    params.bad_words_token_ids = [[8, 9], [10]]
    encoder, decoder = input_codec()
    request = Request("r", [1, 2], params, arrival_time=12.5, cache_salt="s")
    back = from_wire(decoder.decode(encoder.encode(to_wire(request))))
    assert back.sampling_params == params
    for f in dataclasses.fields(SamplingParams):
        assert type(getattr(back.sampling_params, f.name)) is type(getattr(params, f.name)), \
            f.name
    assert (back.request_id, back.prompt_token_ids, back.arrival_time, back.cache_salt) == (
        "r", [1, 2], 12.5, "s")


def test_a_kiln_error_from_the_core_is_raised_as_its_own_kind():
    from kiln.core.core_messages import CoreFailed
    from kiln.engine.core_errors import rebuild_error
    from kiln.executor.rank_errors import WorkerFailedError

    error = rebuild_error(CoreFailed(error_type="WorkerFailedError", message="rank 1 died",
                                      error_module="kiln.executor.rank_errors"))
    assert type(error) is WorkerFailedError and str(error) == "rank 1 died"
    assert type(rebuild_error(CoreFailed(error_type="ValueError", message="m"))) is ValueError
    # Not a built-in nor Kiln's: the front says the core failed, with the core's message.
    other = rebuild_error(CoreFailed(error_type="Boom", message="m", error_module="numpy"))
    assert type(other) is EngineCoreDeadError and "Boom: m" in str(other)


def test_a_field_left_out_takes_its_default():
    fields = encode_params(SamplingParams(max_tokens=3))
    del fields["min_p"]
    assert decode_params(fields) == SamplingParams(max_tokens=3)


# mp_llm: tests/engine/conftest.py's (ENGINE's settings, its core in a process of its own).


def test_the_core_runs_in_another_process_and_matches_in_process(mp_llm, tiny_llama_dir,
                                                                  monkeypatch):
    assert mp_llm.llm_engine.engine_core.pid != os.getpid()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    got = mp_llm.generate(PROMPTS, params, use_tqdm=False)
    monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "0")
    here = LLM(model=str(tiny_llama_dir), **ENGINE)
    try:
        assert here.llm_engine.engine_core.pid == os.getpid()
        want = here.generate(PROMPTS, params, use_tqdm=False)
    finally:
        here.shutdown()
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
        assert [sorted(d) for d in g.outputs[0].logprobs] == \
            [sorted(d) for d in w.outputs[0].logprobs]


def test_a_collective_rpc_past_its_timeout_raises_and_its_late_answer_is_dropped(mp_llm):
    with pytest.raises(TimeoutError, match="'weights_missing' did not finish within its "
                                           "timeout of 1e-09 s"):
        mp_llm.collective_rpc("weights_missing", timeout=1e-9)
    assert mp_llm.collective_rpc("weights_missing", timeout=60) == [0]
    out = mp_llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_the_cores_openmp_threads_spin_briefly_unless_the_user_chose():
    from kiln.engine.core_interpreter import CORE_SPIN_COUNT, core_environment

    assert core_environment({"A": "1"}) == {"A": "1", "GOMP_SPINCOUNT": str(CORE_SPIN_COUNT)}
    assert core_environment({"GOMP_SPINCOUNT": "7"})["GOMP_SPINCOUNT"] == "7"
    chose = core_environment({"OMP_WAIT_POLICY": "PASSIVE"})
    assert chose == {"OMP_WAIT_POLICY": "PASSIVE"}  # a policy alone keeps libgomp's count


def test_the_live_core_has_that_environment(mp_llm):
    from kiln.engine.core_interpreter import core_environment

    pid = mp_llm.llm_engine.engine_core.pid
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    env = dict(item.decode().split("=", 1) for item in raw if b"=" in item)
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        assert env.get(name) == core_environment(os.environ).get(name), name


def test_stats_are_fresh_after_an_abort(mp_llm):
    engine = mp_llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3]},
                       SamplingParams(max_tokens=40, ignore_eos=True))
    while not engine.step():
        pass  # until its prefill ran: it holds blocks
    assert engine.get_stats()["num_running"] == 1
    engine.abort_request("a")
    stats = engine.get_stats()
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
    assert not engine.has_unfinished_requests()


def test_each_core_steps_tokens_are_reported_apart(mp_llm):
    """Whether the front end reads each core step as it comes or several at once (a core that
    ran ahead), the engine reports each core step's tokens apart (iteration_tokens_total), and
    a poll that found no step reports none."""
    engine = mp_llm.llm_engine
    engine.add_request("s", {"prompt_token_ids": [1, 2, 3]},
                       SamplingParams(max_tokens=6, ignore_eos=True))
    time.sleep(0.5)  # the core may run ahead meanwhile; the totals are the same either way
    totals = []
    while engine.has_unfinished_requests():
        engine.step()
        totals += [s.tokens for s in engine.last_steps]
    assert totals == [3 + 1] + [1] * 5


def test_a_core_start_up_error_keeps_its_kind_and_message(tiny_llama_dir, capfd):
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        LLM(model=str(tiny_llama_dir), enforce_eager=True, max_model_len=64,
            kv_cache_memory=1e-9)
    # a setting the user must change is one line from the front end, not the core's traceback
    assert "Traceback" not in capfd.readouterr().err


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


def test_a_kv_cache_smaller_than_one_request_refuses_or_caps(tiny_llama_dir):
    """vLLM's check: one max_model_len request must fit, never be cut short with "length".
    Two blocks of 16 tokens (8 KiB each on this model) hold 32 tokens."""
    tiny = dict(enforce_eager=True, kv_cache_memory=20_000 / 2 ** 30)
    with pytest.raises(ValueError, match=r"To serve at least one request with the model's max "
                       r"seq len \(64\), \(32.00 KiB KV cache is needed, which is larger "
                       r"than the available KV cache memory \(16.00 KiB\).*estimated maximum "
                       r"model length is 32"):
        LLM(model=str(tiny_llama_dir), max_model_len=64, **tiny)
    llm = LLM(model=str(tiny_llama_dir), **tiny)  # the model's own max_model_len: capped
    try:
        assert llm.llm_engine.max_model_len == 32  # the config keeps the model's
        with pytest.raises(ValueError, match="max_model_len 32"):
            llm.generate({"prompt_token_ids": list(range(1, 33))}, use_tqdm=False)
        (out,) = llm.generate({"prompt_token_ids": list(range(1, 20))},
                              SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 32 - 19
    finally:
        llm.shutdown()


def test_a_prestarted_core_interpreter_serves_the_next_engine_or_ends_at_exit(tiny_llama_dir):
    import subprocess
    import sys

    from kiln.engine import core_interpreter

    core_interpreter.prestart()
    prestarted = core_interpreter._prestarted[0]
    llm = LLM(model=str(tiny_llama_dir), **ENGINE)
    try:
        assert llm.llm_engine.engine_core.pid == prestarted.proc.pid
        assert not core_interpreter._prestarted  # taken once
    finally:
        llm.shutdown()
    # A command that fails before its engine exists leaves no core process behind.
    code = ("import sys; from kiln.engine import core_interpreter as c; c.prestart(); "
            "print(c._prestarted[0].proc.pid, flush=True); sys.exit(2)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2
    pid = int(done.stdout.strip())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


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
    # Inductor compile; Inductor compiling into it is test_inductor_stack.py's
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


def test_generate_from_several_threads_runs_one_batch_at_a_time(mp_llm):
    """A second thread's step loop took the first's finished outputs and dropped them: 'engine
    dropped requests' (an in-process core: its forward is not re-entrant)."""
    import concurrent.futures

    params = SamplingParams(temperature=0, max_tokens=6)
    want = [o.outputs[0].token_ids for o in mp_llm.generate(PROMPTS, params, use_tqdm=False)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        runs = [pool.submit(mp_llm.generate, PROMPTS, params, use_tqdm=False) for _ in range(6)]
        for run in runs:
            assert [o.outputs[0].token_ids for o in run.result()] == want


def test_reset_prefix_cache_while_another_thread_generates(mp_llm):
    """The batch's step loop read the reset's answer from the core and dropped it: the reset
    then waited for good. (The module's engine: a reset changes no later answer.)"""
    import threading

    llm = mp_llm
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    started = threading.Event()
    results = []

    def generate():
        started.set()
        results.append(llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 4, params,
                                    use_tqdm=False))
    batch = threading.Thread(target=generate, daemon=True)
    batch.start()
    started.wait()
    resets = threading.Thread(target=lambda: [llm.reset_prefix_cache() for _ in range(10)],
                              daemon=True)
    resets.start()
    resets.join(60)
    batch.join(60)
    assert not resets.is_alive(), "reset_prefix_cache hangs beside a running batch"
    assert len(results) == 1 and all(len(o.outputs[0].token_ids) == 40 for o in results[0])


class PrecisionNamingExecutor:
    """Fails the core's start-up naming torch's float32 matmul precision there."""

    def __init__(self, kiln_config):
        import torch

        from kiln.errors import ConfigError

        raise ConfigError(f"core float32 matmul precision: {torch.get_float32_matmul_precision()}")


def test_the_core_loads_under_the_callers_float32_matmul_precision(tiny_llama_dir):
    # docs/models.md's torch.set_float32_matmul_precision("high") before loading (a GGUF model's
    # float32 kernels read it at load) reached only an in-process core: the core's own
    # interpreter kept torch's default.
    import torch

    from kiln.engine.arg_utils import EngineArgs
    from kiln.engine.llm_engine import LLMEngine
    from kiln.errors import ConfigError

    config = EngineArgs(model=str(tiny_llama_dir), **ENGINE).create_kiln_config()
    before = torch.get_float32_matmul_precision()
    try:
        for precision in ("high", "highest"):
            torch.set_float32_matmul_precision(precision)
            with pytest.raises(ConfigError, match=f"precision: {precision}$"):
                LLMEngine(config, executor_class=PrecisionNamingExecutor, multiprocess=True)
    finally:
        torch.set_float32_matmul_precision(before)


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
