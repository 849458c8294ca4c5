"""Cores the engine core leaves to its front end: the rule, the variable that sets it, and live
cores (a served engine leaves one, `LLM` none) that still give the same tokens."""
import os

import pytest
import torch

from kiln import envs
from kiln.distributed.cpu_binding import cores_to_leave, leave_cores_to_front_end, threads_left
from kiln.engine.arg_utils import EngineArgs
from kiln.engine.llm_engine import LLMEngine
from kiln.sampling_params import SamplingParams

CORES = len(os.sched_getaffinity(0))


def test_threads_left_keeps_at_least_one():
    assert threads_left(8, 1) == 7
    assert threads_left(2, 1) == 1
    assert threads_left(1, 1) == 1
    assert threads_left(4, 0) == 4
    assert threads_left(2, 5) == 1


def test_the_variable_overrides_the_default_and_bad_values_name_it(monkeypatch):
    monkeypatch.delenv("KILN_CPU_NUM_OF_RESERVED_CPU", raising=False)
    assert envs.cpu_num_reserved_cpu(default=1) == 1
    monkeypatch.setenv("KILN_CPU_NUM_OF_RESERVED_CPU", "0")
    assert envs.cpu_num_reserved_cpu(default=1) == 0
    monkeypatch.setenv("KILN_CPU_NUM_OF_RESERVED_CPU", "3")
    assert envs.cpu_num_reserved_cpu(default=0) == 3
    for bad in ("-1", "one", "1.5"):
        monkeypatch.setenv("KILN_CPU_NUM_OF_RESERVED_CPU", bad)
        with pytest.raises(ValueError, match="KILN_CPU_NUM_OF_RESERVED_CPU"):
            envs.cpu_num_reserved_cpu(default=0)


def test_a_users_thread_count_is_kept(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", str(before))
    assert leave_cores_to_front_end(1) is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert leave_cores_to_front_end(0) is None
    assert torch.get_num_threads() == before


def _engine(model_dir, served: bool) -> LLMEngine:
    args = EngineArgs(model=str(model_dir), enforce_eager=True, max_model_len=64,
                      kv_cache_memory=0.01)
    return LLMEngine.from_engine_args(args, served=served)


def _greedy(engine: LLMEngine) -> list[int]:
    engine.add_request("r", {"prompt_token_ids": [1, 2, 3, 4]},
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while True:
        for out in engine.step():
            if out.finished:
                return list(out.outputs[0].token_ids)


def test_a_served_core_leaves_a_core_and_gives_the_same_tokens(tiny_llama_dir, monkeypatch):
    monkeypatch.delenv("KILN_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the cores' default thread count
    offline = _engine(tiny_llama_dir, served=False)
    try:
        assert 1 <= offline.num_threads <= CORES
        want = _greedy(offline)
    finally:
        offline.engine_core.shutdown()
    served = _engine(tiny_llama_dir, served=True)
    try:
        assert served.num_threads == threads_left(offline.num_threads, 1)
        assert _greedy(served) == want
    finally:
        served.engine_core.shutdown()


def test_only_a_cpu_model_in_the_core_without_guards_leaves_cores():
    assert cores_to_leave(1, device="cpu", model_here=True, guarded=False) == 1
    assert cores_to_leave(1, device="cuda", model_here=True, guarded=False) == 0
    assert cores_to_leave(1, device="cpu", model_here=False, guarded=False) == 0  # ranks
    assert cores_to_leave(1, device="cpu", model_here=True, guarded=True) == 0  # mode 1
