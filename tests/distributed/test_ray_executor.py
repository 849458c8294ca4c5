"""TP=2 on the Ray backend: a local Ray started by the test (2 CPUs), rank actors in a
placement group; greedy tokens equal HF's and the actors are gone after shutdown. Placements the
cluster cannot hold fail (at once where it never could), and a stopped rank fails the step,
the stopped one named."""
import os
import re
import signal
import time

import pytest

from kiln.executor import ray_executor, ray_placement
from kiln.executor.rank_errors import WorkerFailedError

from checkpoints import hf_greedy
from parallel_helpers import MAX_TOKENS, PROMPTS, generate_ids, greedy, make_llm


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _groups_left(ray) -> list:
    return [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]


def test_tp2_on_ray_matches_hf_with_the_kiln_settings_and_names_a_dead_rank_over_its_peer(
        local_ray, tiny_llama_dir, monkeypatch, bounded):
    """One engine for three checks (a Ray engine's start is one of this module's costliest
    steps): its actors get the engine's Kiln settings, it gives HF's greedy tokens, and then a
    dead rank is named over its peer's error. A rank SIGKILLed mid-step makes its peers'
    collective fail at once (gloo: connection reset by peer), and that error could reach the
    engine before Ray saw the actor die: the engine then blamed the survivor, with its gloo
    traceback. Forced order here: rank 1's call fails at once (a call no rank answers), rank 0
    is stopped and dies 0.5 s later. (A clean shutdown removing the placement group is
    test_an_engine_core_process_joins_the_callers_ray's.)"""
    import pickle
    import threading

    # Set after the cluster started, so its workers' own environment lacks it, as on a cluster
    # started by `ray start`: the actors must still bind no cores.
    monkeypatch.setenv("KILN_CPU_OMP_THREADS_BIND", "nobind")
    llm = make_llm(tiny_llama_dir, tensor_parallel_size=2, distributed_executor_backend="ray")
    executor = llm.llm_engine.engine_core.executor
    try:
        assert len(executor.actors) == 2
        cores = local_ray.get([actor.__ray_call__.remote(lambda rank: rank.worker.cores)
                               for actor in executor.actors])
        assert cores == [None, None]
        assert generate_ids(llm) == hf_greedy(tiny_llama_dir, PROMPTS, MAX_TOKENS)
    except BaseException:
        llm.llm_engine.engine_core.shutdown()
        raise
    actors = list(executor.actors)
    pid0 = local_ray.get(actors[0].pid.remote())
    os.kill(pid0, signal.SIGSTOP)
    threading.Timer(0.5, os.kill, (pid0, signal.SIGKILL)).start()
    bad = pickle.dumps(("no_such_call", ()))
    refs = [actors[0].call_pickled.remote(bad), actors[1].call_pickled.remote(bad)]
    with pytest.raises(WorkerFailedError, match=r"^worker rank 0 \(Ray actor\) died during "
                                                r"execute_model: "):
        executor._gather(refs, "execute_model")
    assert executor.actors == [] and executor.pg is None


def test_more_ranks_than_the_cluster_has_cpus_fail_at_once(local_ray, tiny_llama_dir):
    started = time.monotonic()
    # (what is available lags: Ray frees the previous test's actors in the background)
    with pytest.raises(ValueError, match=re.escape(
            "Ray cannot place 4 ranks (tensor_parallel_size x pipeline_parallel_size), one "
            "bundle of {'CPU': 1} each: the whole cluster holds less. Asked for {'CPU': 4} in "
            "all; the cluster has {'CPU': 2.0} in all, ") + r"\{.*\} available now\. " + re.escape(
            "Lower -tp / -pp, add nodes or resources to the cluster (ray start --num-cpus")):
        make_llm(tiny_llama_dir, tensor_parallel_size=4, distributed_executor_backend="ray")
    assert time.monotonic() - started < 10  # not Ray's wait for resources that never come
    assert _groups_left(local_ray) == []


def test_a_placement_waiting_for_resources_says_so_then_gives_up(local_ray, tiny_llama_dir,
                                                                 kiln_logs, monkeypatch):
    from ray.util.placement_group import placement_group, remove_placement_group

    monkeypatch.setattr(ray_executor, "STARTUP_TIMEOUT_S", 2.0)
    monkeypatch.setattr(ray_placement, "PLACEMENT_LOG_S", 0.4)
    holder = placement_group([{"CPU": 2}])  # another job holds every CPU
    try:
        local_ray.get(holder.ready(), timeout=60)
        with pytest.raises(ValueError, match=r"Ray cannot place 2 ranks .* still unplaced "
                                               r"after \d+ s\. Asked for \{'CPU': 2\} in all; the "
                                               r"cluster has \{'CPU': 2\.0\} in all, \{\} "
                                               r"available now\. Lower -tp / -pp"):
            make_llm(tiny_llama_dir, tensor_parallel_size=2, distributed_executor_backend="ray")
    finally:
        remove_placement_group(holder)
    waits = [r.getMessage() for r in kiln_logs.records if "for Ray to place" in r.getMessage()]
    assert waits and all(re.fullmatch(
        r"waiting \d+ s so far for Ray to place 2 ranks of \{'CPU': 1\} each; the cluster has "
        r"\{\} available \(of \{'CPU': 2\.0\}\); gives up after 2 s", w) for w in waits), waits
    assert _groups_left(local_ray) == []


def test_a_stopped_rank_fails_the_step_once_the_timeout_passes(local_ray, tiny_llama_dir,
                                                               bounded, monkeypatch):
    monkeypatch.setenv("KILN_EXECUTE_MODEL_TIMEOUT_SECONDS", "1.5")
    llm = make_llm(tiny_llama_dir, tensor_parallel_size=2, distributed_executor_backend="ray")
    engine = llm.llm_engine
    executor = engine.engine_core.executor
    pids = local_ray.get([actor.pid.remote() for actor in executor.actors])
    engine.add_request("r0", {"prompt_token_ids": [5, 6, 7, 8]}, greedy(50))
    engine.step()
    os.kill(pids[1], signal.SIGSTOP)
    try:
        with pytest.raises(WorkerFailedError, match=r"execute_model: worker rank\(s\) 0, 1 did "
                                                    r"not answer within 1.5 s(.|\n)*raise "
                                                    r"KILN_EXECUTE_MODEL_TIMEOUT_SECONDS") as e:
            engine.step()
        # which rank is the cause, as the mp backend names it (test_worker_faults.py)
        assert f"rank 1 (pid {pids[1]}) is stopped" in str(e.value)
    finally:
        for pid in pids:  # Ray's kill of a stopped process lands once it runs again
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert executor.actors == [] and executor.pg is None


def test_an_engine_core_process_joins_the_callers_ray(local_ray, tiny_llama_dir, monkeypatch):
    # LLM's default: the core (and so the executor) in a process of its own, which must place
    # its ranks on the Ray this process started, not start a second one beside it.
    monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "1")
    llm = make_llm(tiny_llama_dir, tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        groups = _groups_left(local_ray)
        assert generate_ids(llm) == hf_greedy(tiny_llama_dir, PROMPTS, MAX_TOKENS)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert [g["bundles"] for g in groups] == [{0: {"CPU": 1.0}, 1: {"CPU": 1.0}}]
    assert _groups_left(local_ray) == []
    assert local_ray.is_initialized()  # the caller's Ray, left running


def test_a_ranks_user_error_at_start_up_is_raised_as_itself(local_ray, tmp_path):
    """As on the mp backend (rank_errors.py): a ValueError a rank raises while loading came
    back as WorkerFailedError holding Ray's whole remote traceback."""
    import json

    from checkpoints import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "m", "llama", tie=False)
    config = json.loads((model / "config.json").read_text())
    # sparse storage Kiln cannot read: refused by the rank building the model
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "dense",
                                     "sparsity_config": {"format": "sparse-24-bitmask"}}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"^quantization_config") as refused:
        make_llm(model, tensor_parallel_size=2, distributed_executor_backend="ray")
    assert not isinstance(refused.value, WorkerFailedError)
    assert "Traceback" not in str(refused.value)
    assert _groups_left(local_ray) == []
