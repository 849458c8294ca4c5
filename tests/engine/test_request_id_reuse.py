"""A request id used again once its namesake was aborted or ended by a stop string in the front
end: the core (in its own process) runs ahead of the front end, so outputs of the old request
can still be on their way; they must not be taken for the new request's."""
import collections
import time

import pytest

from kiln.core.core_messages import StepOutputs
from kiln.core.outputs import EngineCoreOutput
from kiln.core.stats import SchedulerStats
from kiln.engine.core_client import CoreProcClient
from kiln.sampling_params import SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)


# mp_llm: tests/engine/conftest.py's (its core in a process of its own, shared).


def test_outputs_from_before_the_core_took_the_new_add_are_dropped():
    client = CoreProcClient.__new__(CoreProcClient)
    old, new = EngineCoreOutput("x", [5], finish_reason="length"), EngineCoreOutput("x", [7])
    other = EngineCoreOutput("y", [6])
    messages = collections.deque([StepOutputs([old, other], SchedulerStats(), inputs_handled=4),
                                  StepOutputs([new], SchedulerStats(), inputs_handled=5)])
    client._recv = lambda timeout_ms: messages.popleft() if messages else None
    client._pending = collections.deque()
    client._unfinished = {"x": 5, "y": 1}  # "x" added again by the 5th message sent
    client._last_stats = SchedulerStats()
    assert client.step() == [[other], [new]]
    assert client.has_unfinished_requests() and set(client._unfinished) == {"x", "y"}


def test_an_aborted_requests_late_output_does_not_reach_its_successor(mp_llm):
    engine = mp_llm.llm_engine
    new_prompt = {"prompt_token_ids": [7, 3, 9, 11, 4]}
    expected = mp_llm.generate(new_prompt, SamplingParams(max_tokens=5, **GREEDY),
                               use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("x", {"prompt_token_ids": [1, 2, 3]},
                       SamplingParams(max_tokens=1, **GREEDY))
    deadline = time.monotonic() + 30
    while engine.get_stats()["num_running"] + engine.get_stats()["num_waiting"]:
        assert time.monotonic() < deadline  # the core finished it; the front end read nothing
    engine.abort_request("x")
    engine.add_request("x", new_prompt, SamplingParams(max_tokens=5, **GREEDY))
    final = None
    while final is None and time.monotonic() < deadline:
        final = next((o for o in engine.step() if o.finished), None)
    assert final is not None, "the new request was lost"
    assert final.outputs[0].token_ids == expected and final.outputs[0].finish_reason == "length"


def test_a_stop_string_ended_requests_late_tokens_do_not_reach_its_successor(mp_llm):
    engine = mp_llm.llm_engine
    tokenizer = mp_llm.get_tokenizer()
    old_prompt, new_prompt = {"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 4, 2]}
    first = mp_llm.generate(old_prompt, SamplingParams(max_tokens=2, **GREEDY),
                            use_tqdm=False)[0].outputs[0].token_ids
    expected = mp_llm.generate(new_prompt, SamplingParams(max_tokens=6, **GREEDY),
                               use_tqdm=False)[0].outputs[0].token_ids
    stop = tokenizer.decode([first[1]]).strip()
    for _ in range(5):  # the core runs ahead often, not always
        engine.add_request("s", old_prompt, SamplingParams(max_tokens=40, stop=[stop], **GREEDY))
        while not any(o.finished for o in engine.step()):
            pass
        engine.add_request("s", new_prompt, SamplingParams(max_tokens=6, **GREEDY))
        final = None
        while final is None:
            final = next((o for o in engine.step() if o.finished), None)
        assert final.outputs[0].token_ids == expected


def test_a_wall_clock_arrival_time_is_refused_naming_the_clock(mp_llm):
    """vLLM's arrival_time is time.time(); Kiln's queue and latencies read time.monotonic(): a
    ported caller's wall-clock times put its requests behind later ones (helper-57)."""
    engine = mp_llm.llm_engine
    with pytest.raises(ValueError, match=r"arrival_time .* time\.monotonic\(\) values"):
        engine.add_request("wall", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=1),
                           arrival_time=time.time())
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("arrival_time", [float("nan"), float("-inf")])
def test_a_non_finite_arrival_time_is_refused(mp_llm, arrival_time):
    """A NaN arrival time sorts nowhere: the scheduler's queues (keyed by arrival) lost their
    order, a full cache preempted a request already scheduled in the step, and the core died
    ("scheduler sent cached request ... the model runner does not hold")."""
    engine = mp_llm.llm_engine
    with pytest.raises(ValueError, match="arrival_time must be a finite"):
        engine.add_request("nan", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=1),
                           arrival_time=arrival_time)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("request_id,why", [("a\ud800", "surrogate"), (5, "must be a str")])
def test_a_request_id_the_core_cannot_take_is_refused_naming_it(mp_llm, request_id, why):
    """It crosses to the core process as UTF-8: a lone surrogate failed there with a bare
    UnicodeEncodeError (labelled the prompt's on the server)."""
    engine = mp_llm.llm_engine
    with pytest.raises(ValueError, match=rf"^request_id .*{why}"):
        engine.add_request(request_id, {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=1))
    assert not engine.has_unfinished_requests()
    out = mp_llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2, **GREEDY),
                          use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
