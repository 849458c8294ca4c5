"""--scheduling-policy as pure decisions (request_queue.py) and through the Scheduler with the
paged-token double: queue order, the preempted request, n > 1 samples' priority, vLLM V1's
fcfs (priority ignored) and its rule that a waiting request never preempts a running one."""
import pytest

from kiln.config import SchedulerConfig
from kiln.core.parent_request import child_requests
from kiln.core.request import RequestStatus
from kiln.core.request_queue import WaitingQueue, check_priority, order_key, preemption_victim
from kiln.errors import ConfigError
from kiln.sampling_params import SamplingParams

from .doubles import make_request, reference_tokens
from .test_scheduler import drain, make_scheduler, step


def queue(policy, requests):
    keys = {r.request_id: order_key(policy, r, i) for i, r in enumerate(requests)}
    q = WaitingQueue(policy, lambda r: keys[r.request_id])
    for r in requests:
        q.add(r)
    return q, keys


def ids(requests):
    return [r.request_id for r in requests]


def test_priority_orders_by_value_then_arrival_then_insertion():
    rs = [make_request("late0", [1], arrival=5.0, priority=0),
          make_request("early1", [1], arrival=1.0, priority=1),
          make_request("neg", [1], arrival=9.0, priority=-3),
          make_request("early0", [1], arrival=2.0, priority=0),
          make_request("tie0", [1], arrival=2.0, priority=0)]  # same arrival: insertion order
    q, keys = queue("priority", rs)
    assert ids(q) == ["neg", "early0", "tie0", "late0", "early1"]
    assert ids(q) == ids(sorted(rs, key=lambda r: keys[r.request_id]))
    # A preempted request goes back where its key puts it, not to the front (vLLM's heap).
    head = q.pop()
    second = q.pop()
    q.prepend(second)
    q.prepend(head)
    assert ids(q) == ["neg", "early0", "tie0", "late0", "early1"]
    q.remove_all({id(rs[3]), id(rs[2])})
    assert ids(q) == ["tie0", "late0", "early1"] and len(q) == 3 and q.peek().request_id == "tie0"


def test_fcfs_ignores_priority_and_prepends_to_the_front():
    rs = [make_request("a", [1], arrival=1.0, priority=9),
          make_request("b", [1], arrival=2.0, priority=-9),
          make_request("c", [1], arrival=3.0, priority=0)]
    q, keys = queue("fcfs", rs)
    assert ids(q) == ["a", "b", "c"]
    assert keys["a"] == (1.0, 0)  # no priority in an fcfs key
    c = make_request("late", [1], arrival=0.5, priority=-100)
    q.prepend(c)  # to the front, whatever its arrival and priority
    popped = [q.pop(), q.pop()]
    assert ids(popped) == ["late", "a"]
    q.prepend_all(popped)  # back at the front in the given order
    assert ids(q) == ["late", "a", "b", "c"]


@pytest.mark.parametrize("policy, victim", [("priority", "b"), ("fcfs", "c")])
def test_the_victim_is_the_running_request_that_stands_last(policy, victim):
    rs = [make_request("a", [1], arrival=1.0, priority=7),  # largest priority value
          make_request("b", [1], arrival=2.0, priority=7),  # same value, later: the victim
          make_request("c", [1], arrival=3.0, priority=0)]  # latest arrival (fcfs's victim)
    keys = {r.request_id: order_key(policy, r, i) for i, r in enumerate(rs)}
    assert preemption_victim(rs, lambda r: keys[r.request_id]).request_id == victim


@pytest.mark.parametrize("bad, message", [
    (True, "must be an int, got True"), (1.0, "must be an int"), ("1", "must be an int"),
    (None, "must be an int"), (2**63, "64-bit"), (-2**63 - 1, "64-bit")])
def test_check_priority_names_the_field(bad, message):
    with pytest.raises(ValueError, match=f"priority {message}" if "int" in message
                       else message):
        check_priority(bad)
    check_priority(-2**63)
    check_priority(2**63 - 1)


def test_unknown_policy_is_refused_naming_the_flag():
    with pytest.raises(ConfigError, match="--scheduling-policy must be fcfs or priority"):
        SchedulerConfig(policy="sjf")
    with pytest.raises(ValueError, match="--scheduling-policy takes one of fcfs, priority"):
        WaitingQueue("lifo", lambda r: 0)


def test_n_samples_share_their_parent_s_priority_and_arrival():
    parent = make_request("p", [1, 2], arrival=4.0, priority=-5)
    parent.sampling_params = SamplingParams(n=3, max_tokens=2)
    kids = child_requests(parent, ["0_p", "1_p", "2_p"])
    assert [(k.priority, k.arrival_time) for k in kids] == [(-5, 4.0)] * 3


def test_waiting_requests_are_admitted_in_priority_order():
    sched, ex = make_scheduler(max_num_seqs=1, policy="priority")
    for rid, arrival, prio in [("a", 1.0, 2), ("b", 2.0, 1), ("c", 3.0, 0), ("d", 4.0, 1)]:
        sched.add_request(make_request(rid, range(10, 14), max_tokens=2, arrival=arrival,
                                       priority=prio))
    order = []
    while sched.has_unfinished_requests():
        so, _ = step(sched, ex)
        order += [r for r in so.num_scheduled_tokens if r not in order]
    assert order == ["c", "b", "d", "a"]


def test_fcfs_admits_in_arrival_order_whatever_the_priority():
    sched, ex = make_scheduler(max_num_seqs=1)
    for rid, arrival, prio in [("a", 1.0, 2), ("b", 2.0, 1), ("c", 3.0, 0)]:
        sched.add_request(make_request(rid, range(10, 14), max_tokens=2, arrival=arrival,
                                       priority=prio))
    order = []
    while sched.has_unfinished_requests():
        so, _ = step(sched, ex)
        order += [r for r in so.num_scheduled_tokens if r not in order]
    assert order == ["a", "b", "c"]


def _two_growing(policy):
    """a (earliest, priority 5) and b (later, priority 0) decode until 8 blocks of 4 run out."""
    sched, ex = make_scheduler(num_blocks=8, policy=policy, enable_prefix_caching=False)
    sched.add_request(make_request("a", range(10, 22), max_tokens=10, arrival=1.0, priority=5))
    sched.add_request(make_request("b", range(30, 42), max_tokens=10, arrival=2.0, priority=0))
    first = None
    results = {}
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        so, outs = step(sched, ex)
        if so.preempted_req_ids and first is None:
            first = set(so.preempted_req_ids)
        for out in outs:
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert results["a"] == reference_tokens(list(range(10, 22)), 10)
    assert results["b"] == reference_tokens(list(range(30, 42)), 10)
    return first, sched


def test_a_full_cache_preempts_the_largest_priority_not_the_latest_arrival():
    first, sched = _two_growing("priority")
    assert first == {"a"} and sched.num_preemptions >= 1
    first, _ = _two_growing("fcfs")
    assert first == {"b"}  # fcfs: the latest arrival, whatever its priority


def test_a_waiting_urgent_request_preempts_no_running_one():
    # vLLM V1: waiting requests wait for blocks, under either policy.
    sched, ex = make_scheduler(num_blocks=6, policy="priority", enable_prefix_caching=False)
    sched.add_request(make_request("low", range(10, 26), max_tokens=4, arrival=1.0, priority=9))
    step(sched, ex)  # low holds 4 blocks + 1 for its first decode tokens
    sched.add_request(make_request("urgent", range(30, 46), max_tokens=4, arrival=2.0,
                                   priority=-9))
    so, _ = step(sched, ex)
    assert "urgent" not in so.num_scheduled_tokens and not so.preempted_req_ids
    assert sched.requests["low"].status == RequestStatus.RUNNING
    results = drain(sched, ex)
    assert results["urgent"]["tokens"] == reference_tokens(list(range(30, 46)), 4)
    assert sched.num_preemptions == 0


def test_the_budget_goes_to_the_most_urgent_running_request_first():
    # Running requests are kept in priority order, so a chunked prefill of an urgent request
    # takes the step's budget before a less urgent one that was admitted earlier.
    sched, ex = make_scheduler(max_num_batched_tokens=8, policy="priority")
    sched.add_request(make_request("low", range(10, 40), max_tokens=2, arrival=1.0, priority=3))
    so, _ = step(sched, ex)
    assert so.num_scheduled_tokens == {"low": 8}
    sched.add_request(make_request("high", range(50, 80), max_tokens=2, arrival=2.0, priority=0))
    so, _ = step(sched, ex)  # running first: low takes the budget, high waits
    assert so.num_scheduled_tokens == {"low": 8}
    sched.finish_requests("low", RequestStatus.FINISHED_ABORTED)
    so, _ = step(sched, ex)
    assert so.num_scheduled_tokens == {"high": 8}
