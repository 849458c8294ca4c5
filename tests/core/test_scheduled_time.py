"""The scheduler stamps a request's first-scheduled time once (time.monotonic(), at admission),
keeps it across preemption, and hands it to the engine front on every EngineCoreOutput."""
import time

from kiln.core.outputs import EMPTY_MODEL_RUNNER_OUTPUT

from .doubles import make_request
from .test_scheduler import make_scheduler


def timed_step(sched, executor):
    """One step; returns (clock before schedule(), clock after it, scheduler output, outputs)."""
    before = time.monotonic()
    so = sched.schedule()
    after = time.monotonic()
    mro = executor.execute_model(so) if so.total_num_scheduled_tokens else \
        EMPTY_MODEL_RUNNER_OUTPUT
    return before, after, so, sched.update_from_output(so, mro)


def test_stamped_when_first_admitted_not_when_added():
    # One sequence at a time: "b" waits in the queue until "a" has finished.
    sched, ex = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", range(1, 6), max_tokens=3), make_request("b", range(9, 14),
                                                                     max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    assert a.first_scheduled_time is None and b.first_scheduled_time is None
    windows, carried = {}, {}
    while sched.has_unfinished_requests():
        before, after, so, outs = timed_step(sched, ex)
        for new in so.scheduled_new_reqs:
            windows.setdefault(new.req_id, (before, after))
        if "a" in so.num_scheduled_tokens:
            assert b.first_scheduled_time is None  # still queued behind "a"
        for out in outs:
            carried.setdefault(out.request_id, set()).add(out.first_scheduled_time)
    for req in (a, b):
        lo, hi = windows[req.request_id]
        assert req.arrival_time <= lo <= req.first_scheduled_time <= hi
        # Every output of the request carried that one stamp.
        assert carried[req.request_id] == {req.first_scheduled_time}
    assert a.first_scheduled_time < b.first_scheduled_time


def test_preempted_request_keeps_its_first_scheduled_time():
    # 6 blocks of 4 = 24 slots; two requests that each grow to 20 tokens cannot both fit, so
    # the later one ("b") is preempted and later rescheduled from scratch.
    sched, ex = make_scheduler(num_blocks=6)
    a = make_request("a", range(1, 9), max_tokens=12, arrival=1.0)
    b = make_request("b", range(101, 109), max_tokens=12, arrival=2.0)
    sched.add_request(a)
    sched.add_request(b)
    admissions, stamp, carried = [], None, set()
    while sched.has_unfinished_requests():
        before, after, so, outs = timed_step(sched, ex)
        if any(new.req_id == "b" for new in so.scheduled_new_reqs):
            admissions.append((before, after))
            if stamp is None:
                stamp = b.first_scheduled_time
        carried |= {out.first_scheduled_time for out in outs if out.request_id == "b"}
    assert b.num_preemptions >= 1 and len(admissions) >= 2  # it really was rescheduled
    assert admissions[0][0] <= stamp <= admissions[0][1]
    assert stamp < admissions[-1][0]  # the reschedule came later and did not restamp it
    assert b.first_scheduled_time == stamp
    assert carried == {stamp}


def test_never_scheduled_request_reports_no_time():
    # A prompt the cache can never hold is ended from the queue without ever being scheduled.
    sched, ex = make_scheduler(num_blocks=2, max_model_len=64)
    sched.add_request(make_request("huge", range(1, 40), max_tokens=2))
    _, _, _, outs = timed_step(sched, ex)
    (out,) = outs
    assert out.finish_reason == "abort" and out.first_scheduled_time is None
