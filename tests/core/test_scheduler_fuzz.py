"""Seeded random workloads through Scheduler + KVCacheManager, with invariants checked every step.

Random arrivals sharing prefixes, random cache sizes, budgets and limits, random aborts (waiting,
preempted, mid-prefill, decoding), stop tokens that really fire; the executor double checks every
K/V read against the tokens, and each finished request's tokens against the reference model.
Under a sliding window in every layer, blocks behind it are freed and prefix hits need only the
window's: a request holds a bounded number of blocks, and what its window reads is still its own.
"""
import random
from collections import Counter

import pytest

from kiln.core.kv_cache_utils import cdiv
from kiln.core.outputs import EMPTY_MODEL_RUNNER_OUTPUT
from kiln.core.request import RequestStatus
from kiln.core.scheduler import Scheduler
from kiln.core.sliding_window_blocks import num_skipped_blocks, peak_blocks

from .doubles import PagedTokenExecutor, make_config, make_request, reference_tokens


def check_invariants(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    running = [r.request_id for r in sched.running]
    waiting = [r.request_id for r in sched.waiting]
    assert len(running) <= sched.max_num_seqs
    assert len(set(running)) == len(running) and len(set(waiting)) == len(waiting)
    assert not set(running) & set(waiting)
    assert set(running) | set(waiting) == set(sched.requests)
    assert all(r.status == RequestStatus.RUNNING for r in sched.running)
    assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in sched.waiting)
    # The policy's order (request_queue.py): running always, waiting under priority.
    keys = [sched._key(r) for r in sched.running]
    assert keys == sorted(keys)
    if sched.policy == "priority":
        keys = [sched._key(r) for r in sched.waiting]
        assert keys == sorted(keys)
    # Only running requests hold blocks; every reference is one holder; free list = ref 0.
    assert set(kv.req_to_blocks) <= set(running)
    holders = Counter(b.block_id for blocks in kv.req_to_blocks.values() for b in blocks
                      if b is not None)
    for rid, blocks in kv.req_to_blocks.items():
        real = [b for b in blocks if b is not None]
        assert len({b.block_id for b in real}) == len(real), f"{rid} holds a block twice"
        if kv.sliding_window is None:
            assert len(real) == len(blocks)
        else:  # freed ones lead; the rest bounded by the window and a step's tokens
            assert blocks[len(blocks) - len(real):] == real, rid
            assert len(real) <= peak_blocks(10**9, sched.max_num_batched_tokens, 0,
                                            kv.sliding_window, kv.block_size), rid
    for block in pool.blocks:
        assert block.ref_cnt == holders[block.block_id], block
        assert (block.ref_cnt == 0) == (block.block_id in pool.free_block_ids())
    assert pool.num_free_blocks + sum(1 for b in pool.blocks if b.ref_cnt) == pool.num_blocks
    for block_hash, block in pool._cached.items():
        assert block.block_hash == block_hash
    # A block two requests share is a prefix-cache block both reached by the same chain of tokens.
    for request in sched.running:
        blocks = kv.req_to_blocks.get(request.request_id, [])
        assert request.num_computed_tokens <= request.num_tokens
        assert len(blocks) >= cdiv(request.num_computed_tokens, kv.block_size)
        if kv.sliding_window is not None:  # no block the next query's window reads is freed
            skipped = num_skipped_blocks(request.num_computed_tokens, kv.sliding_window,
                                         kv.block_size)
            assert None not in blocks[skipped:], request.request_id
        for i, block in enumerate(blocks):
            if block is not None and block.ref_cnt > 1:
                assert block.block_hash is not None and i < len(request.block_hashes)
                assert request.block_hashes[i] == block.block_hash, (request.request_id, i)


def run_workload(seed: int, steps: int, policy: str = "fcfs", windowed: bool = False,
                 chunked: bool = True) -> int:
    """`chunked=False`: --no-enable-chunked-prefill, the budget raised to max_model_len."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    num_blocks = rng.randrange(2, 40)
    max_num_seqs = rng.randrange(1, 8)
    budget = rng.randrange(max_num_seqs, 40)
    max_model_len = rng.randrange(8, 120)
    window = rng.randrange(1, 24) if windowed else None
    if not chunked:
        budget = max(budget, max_model_len)
    config = make_config(block_size=block_size, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=budget, max_model_len=max_model_len,
                         enable_prefix_caching=rng.random() < 0.7, policy=policy, window=window,
                         chunked_prefill=chunked)
    executor = PagedTokenExecutor(config)
    executor.initialize_cache(num_blocks)
    sched = Scheduler(config, num_blocks)
    prefixes = [[rng.randrange(3, 1000) for _ in range(40)] for _ in range(3)]
    made, finished = {}, {}

    def one_step() -> None:
        check_invariants(sched)
        had_work = sched.has_unfinished_requests()
        so = sched.schedule()
        check_invariants(sched)
        assert so.total_num_scheduled_tokens <= budget
        assert len(so.num_scheduled_tokens) <= max_num_seqs
        assert all(n > 0 for n in so.num_scheduled_tokens.values())
        if not chunked:  # every prompt (or recompute) whole: a step ends on a request's end
            assert all(sched.requests[r].num_computed_tokens == sched.requests[r].num_tokens
                       for r in so.num_scheduled_tokens)
        out = executor.execute_model(so) if so.total_num_scheduled_tokens else EMPTY_MODEL_RUNNER_OUTPUT
        outs = sched.update_from_output(so, out)
        for o in outs:
            assert o.request_id not in finished, f"{o.request_id} reported after it finished"
            if o.finished:
                finished[o.request_id] = o.finish_reason
        # Liveness: a step with work either runs tokens or ends a request (never an idle spin).
        assert not had_work or so.total_num_scheduled_tokens or any(o.finished for o in outs)
        check_invariants(sched)

    for _ in range(steps):
        if rng.random() < 0.3:
            for _ in range(rng.randrange(1, 4)):
                rid = f"r{len(made)}"
                prompt = (rng.choice(prefixes)[:rng.randrange(0, 40)]
                          + [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 20))])
                max_tokens = rng.randrange(1, 30)
                kw = {}
                if rng.random() < 0.3:  # a stop token the fake model will actually produce
                    kw["stop_token_ids"] = [rng.choice(reference_tokens(prompt, max_tokens,
                                                                         window))]
                made[rid] = make_request(rid, prompt, max_tokens=max_tokens,
                                         priority=rng.randrange(-2, 3), **kw)
                sched.add_request(made[rid])
        if rng.random() < 0.1 and sched.requests:
            ids = sorted(sched.requests)
            victims = rng.sample(ids, rng.randrange(1, min(3, len(ids)) + 1))
            sched.finish_requests(victims, RequestStatus.FINISHED_ABORTED)
            finished.update(dict.fromkeys(victims, "abort"))
        one_step()
    for _ in range(3000):
        if not sched.has_unfinished_requests():
            break
        one_step()
    else:
        raise AssertionError(f"seed {seed}: {len(sched.requests)} requests never finished")

    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == num_blocks and all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert kv.req_to_blocks == {} and kv.reset_prefix_cache()
    assert kv.block_pool.num_cached_blocks() == 0
    assert set(finished) == set(made)
    for rid, request in made.items():
        if finished[rid] != "abort":
            produced = request.output_token_ids
            assert produced == reference_tokens(request.prompt_token_ids, len(produced),
                                                window), rid
            if finished[rid] == "stop":
                assert produced[-1] in request.sampling_params.stop_token_ids
    return sched.num_preemptions


@pytest.mark.parametrize("seeds", [range(0, 12), range(12, 24)])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_workloads_keep_invariants(seeds, policy):
    preemptions = sum(run_workload(seed, steps=250, policy=policy) for seed in seeds)
    assert preemptions > 0  # the random caches are small enough to exercise recompute


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_whole_prompt_workloads_keep_invariants(policy):
    """--no-enable-chunked-prefill: the same workloads, each prefill whole in its step."""
    assert sum(run_workload(seed, steps=250, policy=policy, chunked=False)
               for seed in range(200, 224)) > 0


def test_windowed_workloads_free_blocks_behind_the_window():
    """Every layer windowed (1-23 keys): blocks behind the window go back to the pool mid-run,
    prefix hits need only the window's blocks, preemption and aborts as above."""
    assert sum(run_workload(seed, steps=250, windowed=True) for seed in range(100, 112)) > 0
