"""EngineCore end to end with the paged-token executor double: sizing, step loop, outputs."""
import random

import pytest

from kiln.core.engine_core import EngineCore
from kiln.core.request import RequestStatus

from .doubles import PagedTokenExecutor, make_config, make_request, reference_tokens, run_until_done


def test_init_sizes_cache_then_warms_up():
    config = make_config()
    core = EngineCore(config, PagedTokenExecutor)
    assert core.executor.calls == ["determine_num_blocks", "initialize_cache",
                                   "compile_or_warm_up_model"]
    assert core.num_blocks == PagedTokenExecutor.measured_blocks
    assert core.make_stats().num_total_blocks == PagedTokenExecutor.measured_blocks
    assert core.step() == [] and not core.has_unfinished_requests()
    core.shutdown()
    assert core.executor.shut_down


def test_num_gpu_blocks_override_wins():
    config = make_config(override=7)
    core = EngineCore(config, PagedTokenExecutor)
    assert core.num_blocks == 7 and len(core.executor.cache) == 7


def _workload(seed: int, n: int):
    rng = random.Random(seed)
    shared = [rng.randrange(3, 1000) for _ in range(24)]  # a common system-prompt-like prefix
    reqs = []
    for i in range(n):
        own = [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 30))]
        prompt = (shared[:rng.choice([0, 8, 13, 24])] + own) if i % 3 else own
        reqs.append((f"req{i}", prompt, rng.randrange(1, 20)))
    return reqs


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_step_loop_matches_reference_under_pressure(prefix_caching):
    # A small cache (30 blocks of 4) and budget force chunking and preemption.
    config = make_config(override=30, max_num_seqs=6, max_num_batched_tokens=16,
                         enable_prefix_caching=prefix_caching)
    core = EngineCore(config, PagedTokenExecutor)
    workload = _workload(seed=1, n=14)
    for req_id, prompt, max_tokens in workload:
        core.add_request(make_request(req_id, prompt, max_tokens=max_tokens))
    results = run_until_done(core)
    for req_id, prompt, max_tokens in workload:
        assert results[req_id] == [reference_tokens(prompt, max_tokens), "length", None], req_id
    stats = core.make_stats()
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == 30 and stats.kv_cache_usage == 0.0
    if prefix_caching:
        assert 0 < stats.prefix_cache_hits < stats.prefix_cache_queries
    else:
        assert stats.prefix_cache_hits == 0
    assert all(max(r.history) <= 16 for r in core.executor.reqs.values())


def test_prefix_hit_reported_as_cached_tokens():
    core = EngineCore(make_config(), PagedTokenExecutor)
    prompt = list(range(3, 23))  # 20 tokens = 5 full blocks of 4
    core.add_request(make_request("first", prompt, max_tokens=2))
    run_until_done(core)
    core.add_request(make_request("second", prompt + [99], max_tokens=2))
    outs = core.step()
    assert outs[0].num_cached_tokens == 20
    assert run_until_done(core)["second"][0] == reference_tokens(prompt + [99], 2)[1:]
    stats = core.make_stats()
    assert stats.prefix_cache_hits == 20 and stats.prefix_cache_queries == 41


def test_abort_and_stop_string_finish_through_core():
    core = EngineCore(make_config(), PagedTokenExecutor)
    for i in range(3):
        core.add_request(make_request(f"r{i}", range(i, i + 9), max_tokens=40))
    core.step()
    core.step()
    core.abort_requests(["r0", "nope"])
    core.finish_requests(["r1"], RequestStatus.FINISHED_STOPPED)
    assert core.get_num_unfinished_requests() == 1
    results = run_until_done(core)
    assert set(results) == {"r2"} and results["r2"][1] == "length"
    assert core.make_stats().num_free_blocks == PagedTokenExecutor.measured_blocks


def test_interrupted_step_leaves_no_unwritten_blocks_in_the_prefix_cache():
    """Blocks are registered by hash when scheduled; a forward that never ran must take them
    back, or the same prompt afterwards hits blocks nobody wrote."""
    core = EngineCore(make_config(), PagedTokenExecutor)
    prompt = list(range(3, 23))  # 5 full blocks of 4
    core.add_request(make_request("first", prompt, max_tokens=2))
    core.executor.fail_next_step = True
    with pytest.raises(KeyboardInterrupt):
        core.step()
    core.abort_requests(["first"])  # as LLM.generate does when interrupted
    core.add_request(make_request("again", prompt, max_tokens=2))
    outs = core.step()
    assert outs[0].num_cached_tokens == 0
    # the double checks every read against the tokens written, so this also proves the K/V
    assert run_until_done(core)["again"][0] == reference_tokens(prompt, 2)[1:]
    # blocks written by a forward that ran stay cached
    core.add_request(make_request("third", prompt + [99], max_tokens=1))
    assert core.step()[0].num_cached_tokens == 20


def test_a_max_model_len_capped_to_the_cache_reaches_the_scheduler():
    """The model's own max_model_len (512) over a cache of 64 blocks of 4: capped at 256, and
    the scheduler's limits and messages say 256, not the config's 512."""
    core = EngineCore(make_config(max_model_len=None), PagedTokenExecutor)
    assert core.max_model_len == 256 and core.scheduler.max_model_len == 256


def test_reset_prefix_cache_with_running_requests_requeues_them():
    """vLLM's reset_prefix_cache(reset_running_requests=True), used after a weight update:
    the keyword was a TypeError. Running requests hold blocks, so a plain reset is refused;
    with it they go back to the queue and are recomputed, and their outputs are unchanged."""
    core = EngineCore(make_config(), PagedTokenExecutor)
    prompts = {f"r{i}": list(range(3 + i, 23 + i)) for i in range(3)}
    for req_id, prompt in prompts.items():
        core.add_request(make_request(req_id, prompt, max_tokens=6))
    before = {req_id: [] for req_id in prompts}
    for _ in range(3):
        for out in core.step():
            before[out.request_id].extend(out.new_token_ids)
    assert all(before.values())  # every request is decoding
    assert not core.reset_prefix_cache()
    assert core.make_stats().num_preemptions == 0
    assert core.reset_prefix_cache(reset_running_requests=True, reset_connector=False)
    # vLLM counts them as preemptions (kiln:num_preemptions: "to be recomputed")
    assert core.make_stats().num_preemptions == len(prompts)
    assert all(r.num_preemptions == 1 for r in core.scheduler.requests.values())
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.num_cached_blocks() == 0 and core.make_stats().num_free_blocks == pool.num_blocks
    results = run_until_done(core)
    for req_id, prompt in prompts.items():
        assert before[req_id] + results[req_id][0] == reference_tokens(prompt, 6)
    assert core.reset_prefix_cache()
