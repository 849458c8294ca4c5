"""Faults of a 2-rank engine: a rank killed with SIGKILL fails the step in flight with an error
naming it, later steps say why, and every rank exits; a stopped rank fails the step once
KILN_EXECUTE_MODEL_TIMEOUT_SECONDS pass; a rank failing at start-up is a clear error with no
process left behind. Each test is bounded by an alarm, so a hang fails it."""
import os
import signal
import time

import pytest

from kiln.errors import ConfigError
from kiln.executor.rank_errors import WorkerFailedError

from parallel_helpers import greedy, make_llm


def _wait_exited(procs, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        time.sleep(0.05)
    return [p.pid for p in procs if p.is_alive()]


def test_killed_worker_fails_requests_in_flight_naming_its_rank(tiny_llama_dir, bounded):
    llm = make_llm(tiny_llama_dir, tensor_parallel_size=2)
    engine = llm.llm_engine
    procs = list(engine.engine_core.executor.procs)
    engine.add_request("r0", {"prompt_token_ids": [5, 6, 7, 8]}, greedy(50))
    engine.add_request("r1", {"prompt_token_ids": [9, 10, 11]}, greedy(50))
    engine.step()  # both requests are now in flight
    os.kill(procs[1].pid, signal.SIGKILL)
    with pytest.raises(WorkerFailedError, match=r"worker rank 1 \(pid \d+\) was killed by SIGKILL"):
        for _ in range(50):
            engine.step()
    assert _wait_exited(procs) == []
    with pytest.raises(WorkerFailedError, match="workers are gone: worker rank 1"):
        engine.step()
    engine.engine_core.shutdown()  # a second shutdown is harmless


def test_a_long_step_timeout_is_waited_in_slices_and_an_interrupted_step_stops_the_engine(
        tiny_llama_dir, bounded, monkeypatch):
    """VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=1e7 (a deployment's "never"): the wait for the ranks
    passed it whole to poll, whose milliseconds are a C int: OverflowError at the first step,
    and the engine was stopped. A request now runs to its end.

    Then Ctrl-C between sending a step and reading the ranks' replies (an in-process engine in
    a REPL) leaves replies in the pipes: the next step would read them as its own, a step
    behind, with wrong tokens. The engine stops instead, and says why. (One engine for both:
    each start of two ranks costs seconds.)"""
    monkeypatch.delenv("KILN_EXECUTE_MODEL_TIMEOUT_SECONDS", raising=False)
    monkeypatch.setenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "1e7")
    llm = make_llm(tiny_llama_dir, tensor_parallel_size=2)
    engine = llm.llm_engine
    executor = engine.engine_core.executor
    procs = list(executor.procs)
    engine.add_request("short", {"prompt_token_ids": [5, 6, 7, 8]}, greedy(3))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs[-1].outputs[0].token_ids) == 3

    engine.add_request("r0", {"prompt_token_ids": [5, 6, 7, 8]}, greedy(50))
    engine.step()
    collect = executor._collect

    def interrupted(*args, **kwargs):
        executor._collect = collect
        raise KeyboardInterrupt

    executor._collect = interrupted
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    with pytest.raises(WorkerFailedError, match="interrupted .KeyboardInterrupt. before every "
                                                "rank answered; create a new engine"):
        engine.step()
    assert _wait_exited(procs) == []


def test_a_stopped_rank_fails_the_step_once_the_timeout_passes(tiny_llama_dir, bounded,
                                                               monkeypatch):
    """A rank that never answers (SIGSTOP here; a deadlocked collective or a hung device in
    life) used to hang the step, and every request, forever."""
    monkeypatch.setenv("KILN_EXECUTE_MODEL_TIMEOUT_SECONDS", "1.5")
    llm = make_llm(tiny_llama_dir, tensor_parallel_size=2)
    engine = llm.llm_engine
    procs = list(engine.engine_core.executor.procs)
    engine.add_request("r0", {"prompt_token_ids": [5, 6, 7, 8]}, greedy(50))
    engine.step()
    os.kill(procs[1].pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        # rank 0 waits for rank 1 in the step's collectives: neither answers
        with pytest.raises(WorkerFailedError, match=r"execute_model: worker rank\(s\) 0, 1 did "
                                                    r"not answer within 1.5 s(.|\n)*raise "
                                                    r"KILN_EXECUTE_MODEL_TIMEOUT_SECONDS") as e:
            engine.step()
        # ... and which one is to blame: rank 0 only waits for it.
        assert f"rank 1 (pid {procs[1].pid}) is stopped" in str(e.value)
        assert "rank 0 (pid" not in str(e.value)
        assert time.monotonic() - started < 10
        assert _wait_exited(procs) == []
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                os.kill(proc.pid, signal.SIGCONT)
                proc.join(5)
    with pytest.raises(WorkerFailedError, match="workers are gone: execute_model"):
        engine.step()


def test_the_step_timeout_is_checked_before_any_rank_starts(tiny_llama_dir, monkeypatch):
    import multiprocessing

    from kiln import envs

    monkeypatch.delenv("KILN_EXECUTE_MODEL_TIMEOUT_SECONDS", raising=False)
    assert envs.execute_model_timeout_s() == 300.0
    monkeypatch.setenv("KILN_EXECUTE_MODEL_TIMEOUT_SECONDS", "0.25")
    assert envs.execute_model_timeout_s() == 0.25
    before = len(multiprocessing.active_children())
    for bad in ("abc", "0", "-1", "nan", "inf"):
        monkeypatch.setenv("KILN_EXECUTE_MODEL_TIMEOUT_SECONDS", bad)
        with pytest.raises(ValueError, match=rf"KILN_EXECUTE_MODEL_TIMEOUT_SECONDS='{bad}' must "
                                             "be a finite number of seconds > 0"):
            make_llm(tiny_llama_dir, tensor_parallel_size=2)
    assert len(multiprocessing.active_children()) == before


def test_rank_failing_at_start_up_is_named_and_leaves_no_process(tiny_llama_dir, bounded,
                                                                  monkeypatch):
    import multiprocessing

    # Read by the ranks only, as they size their KV caches: the user's to fix, so the rank's
    # ConfigError is raised as itself, in one line, as with one rank (rank_errors.py)
    monkeypatch.setenv("KILN_CPU_KVCACHE_SPACE", "abc")
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(ConfigError, match=r"KILN_CPU_KVCACHE_SPACE") as refused:
        make_llm(tiny_llama_dir, tensor_parallel_size=2)
    assert "Traceback" not in str(refused.value)
    left = [p for p in multiprocessing.active_children() if p.pid not in before]
    assert _wait_exited(left) == []


def test_model_that_does_not_split_is_refused_before_any_rank_starts(tiny_llama_dir):
    import multiprocessing

    before = len(multiprocessing.active_children())
    # 4 attention heads and 2 KV heads over 3 ranks
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by "
                                         r"tensor_parallel_size \(3\)"):
        make_llm(tiny_llama_dir, tensor_parallel_size=3)
    assert len(multiprocessing.active_children()) == before


class _SlowWorker:
    """A rank's worker whose step outlasts the engine that asked for it."""

    def __init__(self, *args):
        pass

    def call_pickled(self, payload):
        time.sleep(0.5)
        return 1

    def shutdown(self):
        pass


def _rank_alone(engine_end, *args):
    """A rank whose copy of the engine's end is closed, as a spawned rank has none."""
    from kiln.executor.multiproc_executor import _rank_main

    engine_end.close()
    _rank_main(*args)


def test_a_rank_whose_engine_left_mid_step_exits_quietly(monkeypatch, capfd):
    """`kiln serve`'s third stop signal ends the engine at once: a rank finishing its step
    then replies into a closed pipe, and printed a BrokenPipeError traceback per rank."""
    import multiprocessing

    from kiln.executor import rank_worker

    monkeypatch.setattr(rank_worker, "RankWorker", _SlowWorker)  # the forked child's too
    ctx = multiprocessing.get_context("fork")
    engine_end, rank_end = ctx.Pipe()
    rank = ctx.Process(target=_rank_alone,
                       args=(engine_end, None, 0, 1, "", rank_end, os.getpid()))
    rank.start()
    rank_end.close()
    assert engine_end.recv() == ("ok", None)
    engine_end.send_bytes(b"step")
    engine_end.close()  # the engine is gone before the rank answers
    rank.join(10)
    assert rank.exitcode == 0
    assert "BrokenPipeError" not in capfd.readouterr().err
