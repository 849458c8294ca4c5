"""A step whose forward fails (Ctrl-C in LLM.generate) must not lose what the runner must forget.

Before the fix, schedule() dropped its forget-lists as soon as it built a non-empty step; when that
step's forward then raised, the runner never heard of the requests finished before it and kept
their rows, so after a few interrupted generate() calls it refused new requests (max_num_seqs).
"""
import pytest

from kiln.core.engine_core import EngineCore
from kiln.core.scheduler import Scheduler

from .doubles import PagedTokenExecutor, make_config, make_request, reference_tokens, run_until_done


def test_requests_finished_before_a_failed_step_are_still_forgotten_by_the_runner():
    core = EngineCore(make_config(), PagedTokenExecutor)
    core.add_request(make_request("a", range(3, 10), max_tokens=1))
    core.add_request(make_request("b", range(20, 30), max_tokens=5))
    assert [o.request_id for o in core.step() if o.finished] == ["a"]
    core.executor.fail_next_step = True
    with pytest.raises(KeyboardInterrupt):
        core.step()  # would have told the runner to forget "a"
    core.abort_requests(["b"])  # as LLM.generate does when interrupted
    core.add_request(make_request("c", range(40, 45), max_tokens=2))
    assert run_until_done(core)["c"][0] == reference_tokens(range(40, 45), 2)
    delivered = set().union(*(so.finished_req_ids for so in core.executor.outputs))
    assert {"a", "b"} <= delivered
    assert "a" not in core.executor.reqs and "b" not in core.executor.reqs


def test_preemption_notice_survives_a_step_that_never_ran():
    # 4 blocks of 4: "a" growing past its 2 blocks preempts "b".
    config = make_config()
    sched, ex = Scheduler(config, num_blocks=4), PagedTokenExecutor(config)
    ex.initialize_cache(4)
    sched.add_request(make_request("a", range(3, 9), max_tokens=8, arrival=1.0))
    sched.add_request(make_request("b", range(50, 56), max_tokens=8, arrival=2.0))
    for _ in range(20):
        so = sched.schedule()
        if "b" in so.preempted_req_ids:
            break
        sched.update_from_output(so, ex.execute_model(so))
    else:
        raise AssertionError("b was never preempted")
    assert so.total_num_scheduled_tokens > 0  # "a" ran in that step
    # Its forward fails: update_from_output is never called. The next step must carry the news.
    retry = sched.schedule()
    assert "b" in retry.preempted_req_ids and "b" in retry.finished_req_ids


@pytest.mark.parametrize("fail_at", [1, 2, 5])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_stepping_on_after_a_failed_step_gives_the_tokens_of_a_clean_run(fail_at, policy):
    """A caller of the core that goes on after a failed step (no abort): the step's requests
    computed nothing and are computed again, so every request ends as in a run without it."""
    prompts = {"a": range(3, 12), "b": range(20, 26), "c": range(40, 53)}

    def run(fail: bool) -> dict:
        core = EngineCore(make_config(max_num_batched_tokens=8, policy=policy),
                          PagedTokenExecutor)
        for i, (rid, prompt) in enumerate(prompts.items()):
            core.add_request(make_request(rid, prompt, max_tokens=6, arrival=float(i),
                                          priority=[2, 0, 1][i]))
        results = {}
        for step in range(200):
            if not core.has_unfinished_requests():
                return results
            core.executor.fail_next_step = fail and step == fail_at
            try:
                outputs = core.step()
            except KeyboardInterrupt:
                continue
            for out in outputs:
                results.setdefault(out.request_id, []).extend(out.new_token_ids)
        raise AssertionError("did not finish")

    clean, failed = run(False), run(True)
    assert clean == {rid: reference_tokens(p, 6) for rid, p in prompts.items()}
    assert failed == clean


def test_a_failure_inside_schedule_takes_its_step_back():
    """schedule() commits its step (admissions, computed tokens) before it builds the grammar
    bitmask; that raising (xgrammar, a Ctrl-C there) left requests counted as computed that
    never ran, and the next step failed: "finished its prefill but the runner returned no
    sampled token" (helper-21)."""
    core = EngineCore(make_config(), PagedTokenExecutor)
    manager = core.scheduler.structured_output_manager
    bitmask, failed = manager.grammar_bitmask, []

    def fails_once(requests):
        if not failed:
            failed.append(True)
            raise RuntimeError("injected")
        return bitmask(requests)

    manager.grammar_bitmask = fails_once
    core.add_request(make_request("a", range(3, 12), max_tokens=4))
    with pytest.raises(RuntimeError, match="injected"):
        core.step()
    assert run_until_done(core)["a"][0] == reference_tokens(range(3, 12), 4)


def test_a_request_admitted_again_after_a_failed_step_is_not_counted_twice_in_prefix_stats():
    """A failed step puts its requests back as a preemption does, but without counting one: its
    prompt was looked up in the prefix cache again and counted again (queries, hits)."""
    core = EngineCore(make_config(), PagedTokenExecutor)
    core.add_request(make_request("a", range(3, 20), max_tokens=2))
    core.executor.fail_next_step = True
    with pytest.raises(KeyboardInterrupt):
        core.step()
    run_until_done(core)
    assert core.make_stats().prefix_cache_queries == 17  # the prompt's tokens, once
