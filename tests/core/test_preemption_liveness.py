"""Liveness under KV-cache pressure: preemption makes progress, nothing spins or ping-pongs forever."""
from kiln.core.engine_core import EngineCore

from .doubles import PagedTokenExecutor, make_config, make_request, reference_tokens, run_until_done


def test_single_request_using_the_whole_cache_finishes():
    # 4 blocks of 4 = 16 slots, max_model_len 16 (a longer one is refused at start): a 10-token
    # prompt and 6 outputs reach it, computing 15 tokens (the last sampled needs no slot).
    core = EngineCore(make_config(override=4, max_model_len=16), PagedTokenExecutor)
    core.add_request(make_request("whole", range(3, 13), max_tokens=6))
    results = run_until_done(core, max_steps=50)
    assert results["whole"] == [reference_tokens(range(3, 13), 6), "length", None]
    assert core.make_stats().num_preemptions == 0


def test_one_token_past_the_cache_is_cut_short_as_length():
    core = EngineCore(make_config(override=4, max_model_len=16), PagedTokenExecutor)
    core.add_request(make_request("over", range(3, 13), max_tokens=9))
    results = run_until_done(core, max_steps=50)
    assert results["over"] == [reference_tokens(range(3, 13), 6), "length", None]
    assert core.make_stats().num_free_blocks == 4


def test_requests_needing_more_than_the_cache_together_all_finish():
    # 8 blocks of 4 = 32 slots; six requests of up to 28 tokens each: only one fits at its end.
    config = make_config(override=8, max_num_seqs=6, max_num_batched_tokens=12, max_model_len=32)
    core = EngineCore(config, PagedTokenExecutor)
    prompts = {f"r{i}": list(range(10 * i + 3, 10 * i + 3 + 8 + i)) for i in range(6)}
    for i, (rid, prompt) in enumerate(prompts.items()):
        core.add_request(make_request(rid, prompt, max_tokens=20 - i, arrival=float(i)))
    results = run_until_done(core, max_steps=600)
    for i, (rid, prompt) in enumerate(prompts.items()):
        assert results[rid] == [reference_tokens(prompt, 20 - i), "length", None], rid
    stats = core.make_stats()
    assert stats.num_preemptions > 0 and stats.num_free_blocks == 8
    # Progress, not ping-pong: the oldest running request is never the one preempted, so the
    # requests finish in arrival order.
    finish_step = {}
    for step, so in enumerate(core.executor.outputs):
        for rid in so.finished_req_ids - so.preempted_req_ids:
            finish_step.setdefault(rid, step)
    order = sorted(prompts, key=lambda r: finish_step.get(r, len(core.executor.outputs)))
    assert order == list(prompts)
