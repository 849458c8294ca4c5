"""Scheduler: token budget, chunked prefill, ordering, limits, preemption, stop checks, abort."""
from kiln.core.outputs import EMPTY_MODEL_RUNNER_OUTPUT
from kiln.core.request import RequestStatus
from kiln.core.scheduler import Scheduler

from .doubles import PagedTokenExecutor, make_config, make_request, reference_tokens


def make_scheduler(num_blocks=64, **kw):
    config = make_config(**kw)
    executor = PagedTokenExecutor(config)
    executor.initialize_cache(num_blocks)
    return Scheduler(config, num_blocks), executor


def step(sched, executor):
    so = sched.schedule()
    if so.total_num_scheduled_tokens == 0:
        return so, sched.update_from_output(so, EMPTY_MODEL_RUNNER_OUTPUT)
    return so, sched.update_from_output(so, executor.execute_model(so))


def drain(sched, executor, max_steps=500, earlier_outputs=()):
    results = {}
    for outs in [earlier_outputs] + [None] * max_steps:
        if outs is None:
            if not sched.has_unfinished_requests():
                return results
            outs = step(sched, executor)[1]
        for out in outs:
            entry = results.setdefault(out.request_id, {"tokens": [], "finish": None})
            entry["tokens"] += out.new_token_ids
            entry["finish"], entry["stop_reason"] = out.finish_reason, out.stop_reason
    raise AssertionError("scheduler did not finish")


def test_chunked_prefill_splits_by_budget_and_reports_only_when_done():
    sched, ex = make_scheduler(max_num_batched_tokens=16)
    prompt = list(range(10, 50))  # 40 tokens -> chunks of 16, 16, 8
    sched.add_request(make_request("a", prompt, max_tokens=2))
    chunks = []
    for _ in range(3):
        so, outs = step(sched, ex)
        chunks.append(so.num_scheduled_tokens["a"])
        if len(chunks) < 3:
            assert outs == []  # a partial prefill produces nothing
    assert chunks == [16, 16, 8]
    assert outs[0].new_token_ids == reference_tokens(prompt, 1) and not outs[0].finished
    assert outs[0].new_logprobs and outs[0].new_logprobs[0].token_ids == outs[0].new_token_ids
    so, outs = step(sched, ex)
    assert so.num_scheduled_tokens == {"a": 1} and outs[0].finish_reason == "length"


def test_without_chunked_prefill_a_prompt_waits_whole_and_holds_later_ones():
    """vLLM's --no-enable-chunked-prefill: a prompt that does not fit what is left of the
    step's budget is not cut; it ends the step's admissions (vLLM V1's), later ones wait."""
    for chunked, first in ((True, {"a": 40, "b": 24}), (False, {"a": 40})):
        sched, ex = make_scheduler(max_num_batched_tokens=64, max_model_len=64,
                                   chunked_prefill=chunked)
        prompts = {"a": range(10, 50), "b": range(100, 140), "c": range(200, 210)}
        for i, (rid, prompt) in enumerate(prompts.items()):
            sched.add_request(make_request(rid, prompt, max_tokens=3, arrival=float(i)))
        so, outs = step(sched, ex)
        assert so.num_scheduled_tokens == first
        if not chunked:
            so, more = step(sched, ex)
            assert so.num_scheduled_tokens == {"a": 1, "b": 40, "c": 10}
            outs += more
        results = drain(sched, ex, earlier_outputs=outs)
        for rid, prompt in prompts.items():
            assert results[rid]["tokens"] == reference_tokens(list(prompt), 3), rid


def test_without_chunked_prefill_a_long_prompt_is_not_starved_by_short_ones():
    """Short prompts arriving every step keep decodes running; were they let past a long
    prompt that needs an almost empty step, it would never be scheduled."""
    sched, ex = make_scheduler(max_num_batched_tokens=64, max_model_len=64,
                               chunked_prefill=False)
    for i in range(4):
        sched.add_request(make_request(f"p{i}", range(300 + i, 310 + i), max_tokens=4,
                                       arrival=float(i)))
    step(sched, ex)
    sched.add_request(make_request("long", range(10, 72), max_tokens=2, arrival=10.0))
    for i in range(12):
        sched.add_request(make_request(f"s{i}", range(400 + i, 410 + i), max_tokens=4,
                                       arrival=20.0 + i))
        so, _ = step(sched, ex)
        if "long" in so.num_scheduled_tokens:
            assert so.num_scheduled_tokens["long"] == 62
            break
    else:
        raise AssertionError("the long prompt waited 12 steps behind short ones")


def test_running_decodes_are_scheduled_before_waiting_prefills():
    sched, ex = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(make_request("a", range(6), max_tokens=5, arrival=1.0))
    sched.add_request(make_request("b", range(100, 130), max_tokens=5, arrival=2.0))
    so, _ = step(sched, ex)
    assert so.num_scheduled_tokens == {"a": 6, "b": 10}
    sched.add_request(make_request("c", range(200, 210), max_tokens=5, arrival=3.0))
    so, _ = step(sched, ex)
    # a decodes (1), b continues its prefill (15 of the remaining 20); c must wait for budget.
    assert list(so.num_scheduled_tokens.items()) == [("a", 1), ("b", 15)]
    assert so.scheduled_cached_reqs.req_ids == ["a", "b"] and so.scheduled_new_reqs == []
    so, _ = step(sched, ex)
    assert list(so.num_scheduled_tokens.items()) == [("a", 1), ("b", 5), ("c", 10)]


def test_max_num_seqs_limits_running_requests():
    sched, ex = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", range(i * 10, i * 10 + 5), max_tokens=3))
    so, outs = step(sched, ex)
    assert set(so.num_scheduled_tokens) == {"r0", "r1"}
    assert sched.make_stats().num_waiting == 1
    results = drain(sched, ex, earlier_outputs=outs)
    assert all(results[f"r{i}"]["tokens"] == reference_tokens(range(i * 10, i * 10 + 5), 3)
               for i in range(3))


def test_preemption_when_blocks_run_out_and_resume_with_outputs():
    # 6 blocks of 4 = 24 slots; two requests that each grow to 20 tokens cannot both fit.
    sched, ex = make_scheduler(num_blocks=6)
    pa, pb = list(range(1, 9)), list(range(101, 109))
    sched.add_request(make_request("a", pa, max_tokens=12, arrival=1.0))
    sched.add_request(make_request("b", pb, max_tokens=12, arrival=2.0))
    results = drain(sched, ex)
    assert results["a"]["tokens"] == reference_tokens(pa, 12)
    assert results["b"]["tokens"] == reference_tokens(pb, 12)
    assert results["a"]["finish"] == results["b"]["finish"] == "length"
    stats = sched.make_stats()
    assert stats.num_preemptions >= 1 and stats.num_free_blocks == 6
    # The later arrival is the victim, and it comes back with its generated tokens.
    assert any("b" in so.preempted_req_ids and "b" in so.finished_req_ids for so in ex.outputs)
    assert not any("a" in so.preempted_req_ids for so in ex.outputs)
    resumed = [n for so in ex.outputs for n in so.scheduled_new_reqs if n.req_id == "b"][1:]
    assert resumed and resumed[0].output_token_ids and resumed[0].num_computed_tokens >= 0
    assert resumed[0].prompt_token_ids == pb


def test_stop_token_and_min_tokens():
    prompt = list(range(40, 47))
    ref = reference_tokens(prompt, 12)
    stop = ref[2]
    assert stop not in ref[:2]
    sched, ex = make_scheduler()
    sched.add_request(make_request("s", prompt, max_tokens=12, stop_token_ids=[stop]))
    later = next((i for i in range(5, 12) if ref[i] == stop), None)
    sched.add_request(make_request("m", prompt, max_tokens=12, stop_token_ids=[stop], min_tokens=5))
    results = drain(sched, ex)
    assert results["s"] == {"tokens": ref[:3], "finish": "stop", "stop_reason": stop}
    expected = ref if later is None else ref[:later + 1]
    assert results["m"]["tokens"] == expected  # the early stop token is ignored below min_tokens


def test_eos_stops_without_stop_reason_unless_ignored():
    prompt = list(range(60, 66))
    ref = reference_tokens(prompt, 6)
    sched, ex = make_scheduler()
    eos_req = make_request("eos", prompt, max_tokens=6)
    eos_req.sampling_params.update_from_tokenizer(eos_token_id=ref[1], vocab_size=1000)
    ignore = make_request("ignore", prompt, max_tokens=6, ignore_eos=True)
    ignore.sampling_params.update_from_tokenizer(eos_token_id=ref[1], vocab_size=1000)
    sched.add_request(eos_req)
    sched.add_request(ignore)
    results = drain(sched, ex)
    assert results["eos"] == {"tokens": ref[:2], "finish": "stop", "stop_reason": None}
    assert results["ignore"]["tokens"] == ref and results["ignore"]["finish"] == "length"
    # eos listed in stop_token_ids too: still no stop_reason (vLLM checks eos first), unless
    # ignore_eos leaves only the explicit stop token
    sched, ex = make_scheduler()
    for name, ignore_eos in (("eos", False), ("listed", True)):
        req = make_request(name, prompt, max_tokens=6, stop_token_ids=[ref[1]],
                           ignore_eos=ignore_eos)
        req.sampling_params.update_from_tokenizer(eos_token_id=ref[1], vocab_size=1000)
        sched.add_request(req)
    results = drain(sched, ex)
    assert results["eos"] == {"tokens": ref[:2], "finish": "stop", "stop_reason": None}
    assert results["listed"] == {"tokens": ref[:2], "finish": "stop", "stop_reason": ref[1]}


def test_max_model_len_caps_generation():
    sched, ex = make_scheduler(max_model_len=12)
    prompt = list(range(10))
    sched.add_request(make_request("a", prompt, max_tokens=100))
    results = drain(sched, ex)
    assert results["a"]["tokens"] == reference_tokens(prompt, 2)
    assert results["a"]["finish"] == "length"


def test_abort_frees_blocks_and_tells_the_runner():
    sched, ex = make_scheduler(max_num_seqs=2, max_num_batched_tokens=8)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", range(i * 20, i * 20 + 12), max_tokens=50))
    for _ in range(4):
        step(sched, ex)
    assert sched.make_stats().num_free_blocks < 64
    sched.finish_requests(["r0", "r2", "unknown"], RequestStatus.FINISHED_ABORTED)  # r2 waiting
    sched.finish_requests("r0", RequestStatus.FINISHED_ABORTED)  # twice: harmless
    assert sched.get_num_unfinished_requests() == 1
    so, _ = step(sched, ex)
    assert {"r0", "r2"} <= so.finished_req_ids and set(so.num_scheduled_tokens) == {"r1"}
    sched.finish_requests(["r1"], RequestStatus.FINISHED_STOPPED)
    stats = sched.make_stats()
    assert not sched.has_unfinished_requests()
    assert stats.num_free_blocks == 64 and stats.kv_cache_usage == 0.0
    assert stats.num_running == stats.num_waiting == 0


def test_prompt_larger_than_cache_is_aborted_not_hung():
    sched, ex = make_scheduler(num_blocks=4)  # 16 token slots
    sched.add_request(make_request("huge", range(20), max_tokens=2))
    sched.add_request(make_request("ok", range(100, 105), max_tokens=2))
    so, outs = step(sched, ex)
    assert [(o.request_id, o.finish_reason) for o in outs if o.finished] == [("huge", "abort")]
    # the client learns why, not only the log
    huge = next(o for o in outs if o.request_id == "huge")
    assert "needs 20 tokens of KV cache" in huge.error and "--kv-cache-memory" in huge.error
    assert "huge" in so.finished_req_ids and "huge" not in so.num_scheduled_tokens
    results = drain(sched, ex, earlier_outputs=[o for o in outs if o.request_id == "ok"])
    assert results["ok"]["tokens"] == reference_tokens(range(100, 105), 2)


def test_cache_overflow_names_the_override_that_sized_the_cache():
    """With --num-gpu-blocks-override set, only it sizes the cache (memory flags do not)."""
    sched, ex = make_scheduler(num_blocks=4, override=4)  # 16 token slots
    sched.add_request(make_request("huge", range(20), max_tokens=2))
    (out,) = [o for o in step(sched, ex)[1] if o.request_id == "huge"]
    assert out.finish_reason == "abort"
    assert "--num-gpu-blocks-override (set to 4)" in out.error
    assert "--kv-cache-memory" not in out.error


def test_empty_step_keeps_forget_list_and_reports_scheduler_finishes():
    sched, ex = make_scheduler(num_blocks=4, max_model_len=64)
    sched.add_request(make_request("a", range(5), max_tokens=10))
    step(sched, ex)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    sched.add_request(make_request("toolong", range(80), max_tokens=1))  # > max_model_len
    so, outs = step(sched, ex)
    assert so.total_num_scheduled_tokens == 0 and outs[0].finish_reason == "abort"
    sched.add_request(make_request("b", range(7), max_tokens=1))
    so, _ = step(sched, ex)
    assert {"a", "toolong"} <= so.finished_req_ids  # carried to the first executed step
    assert not sched.has_unfinished_requests()  # b finished in that step
    assert sched.finished_req_ids == {"b"}  # a and toolong were delivered, b waits for the next


def test_duplicate_request_id_rejected():
    sched, _ = make_scheduler()
    sched.add_request(make_request("x", range(3)))
    try:
        sched.add_request(make_request("x", range(3)))
    except ValueError as e:
        assert "x" in str(e)
    else:
        raise AssertionError("duplicate id accepted")
