"""LLM(data_parallel_size=2): two engine core replicas; outputs come back in input order with the
greedy tokens of one engine, both replicas take requests, and utility calls reach both."""
import pytest

from kiln.entrypoints.llm import LLM
from kiln.sampling_params import SamplingParams

from checkpoints import random_prompts

PROMPTS = [{"prompt_token_ids": p} for p in random_prompts(6, [5, 9, 3, 12, 7, 4], seed=3)]
GREEDY = SamplingParams(max_tokens=6, temperature=0)


def replica_index(worker) -> int:
    """collective_rpc's function: the replica a worker belongs to."""
    return worker.kiln_config.parallel_config.data_parallel_rank


@pytest.fixture(scope="module")
def dp_llm(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), enforce_eager=True, data_parallel_size=2,
              kv_cache_memory=0.01, enable_lora=True, max_lora_rank=8)
    yield llm
    llm.llm_engine.shutdown()


def slow_on_replica_1(worker) -> int:
    """collective_rpc's function: replica 1 takes 3 s, replica 0 answers at once."""
    import time
    if replica_index(worker) == 1:
        time.sleep(3)
    return replica_index(worker)


def meet_the_other_replica(worker, where: str) -> bool:
    """collective_rpc's function: leaves its replica's mark in `where`, then waits (up to 10 s)
    for the other's; True once both are there."""
    import os
    import time
    os.close(os.open(os.path.join(where, str(replica_index(worker))), os.O_CREAT))
    for _ in range(1000):
        if len(os.listdir(where)) == 2:
            return True
        time.sleep(0.01)
    return False


def adapters_read(worker) -> list[int]:
    """collective_rpc's function: the lora_int_ids a worker has read."""
    return list(worker.model_runner.lora_manager.host)


def _tokens(llm) -> list:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_dp2_returns_dp1s_greedy_tokens_in_input_order(dp_llm, tiny_llama_dir):
    got = _tokens(dp_llm)
    # both replicas ran some of them
    engines = dp_llm.llm_engine.get_stats()["engines"]
    assert len(engines) == 2 and all(e["prefix_cache_queries"] > 0 for e in engines), engines
    one = LLM(model=str(tiny_llama_dir), enforce_eager=True, kv_cache_memory=0.01)
    try:
        assert got == _tokens(one)
    finally:
        one.llm_engine.shutdown()


def test_utility_calls_reach_every_replica(dp_llm, tmp_path):
    # it runs on every replica; replica 0's results come back, one per rank (as vLLM's)
    assert dp_llm.collective_rpc(replica_index) == [0]
    assert dp_llm.llm_engine.reset_prefix_cache() is True
    # the timeout bounds both replicas' calls together (replica 1's ran too)
    with pytest.raises(TimeoutError, match="slow_on_replica_1.* timeout of 1 s"):
        dp_llm.collective_rpc(slow_on_replica_1, timeout=1)
    assert dp_llm.collective_rpc(slow_on_replica_1, timeout=30) == [0]
    # the replicas run it at the same time, as vLLM's (one after another, replica 0 waited
    # for replica 1, which had not started): a timeout fit for one replica fits both
    assert dp_llm.collective_rpc(meet_the_other_replica, args=(str(tmp_path),),
                                 timeout=30) == [True]
    dp_llm.sleep(level=0)
    clients = dp_llm.llm_engine.engine_core.clients
    assert [c.is_sleeping() for c in clients] == [True, True]
    dp_llm.wake_up()
    assert [c.is_sleeping() for c in clients] == [False, False]
    assert len(_tokens(dp_llm)) == len(PROMPTS)


def test_an_adapter_given_at_run_time_runs_on_every_replica(dp_llm, tiny_llama_dir, tmp_path):
    from lora_adapters import greedy, merged_model, write_adapter

    from kiln.lora.request import LoRARequest

    adapter = write_adapter(tmp_path / "a1", tiny_llama_dir, seed=1)
    lora = LoRARequest("a1", 1, str(adapter))
    prompts = [p["prompt_token_ids"] for p in PROMPTS[:4]]
    outs = dp_llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False, lora_request=lora)
    clients = dp_llm.llm_engine.engine_core.clients  # each replica read it
    assert [c.collective_rpc(adapters_read) for c in clients] == [[[1]], [[1]]]
    want = greedy(merged_model(tiny_llama_dir, adapter), prompts, GREEDY.max_tokens)
    assert [list(o.outputs[0].token_ids) for o in outs] == want


def test_dp_needs_core_processes(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "0")
    with pytest.raises(ValueError, match="data_parallel_size 2 runs each replica in a process "
                       "of its own; unset KILN_ENABLE_V1_MULTIPROCESSING=0"):
        LLM(model=str(tiny_llama_dir), enforce_eager=True, data_parallel_size=2)
