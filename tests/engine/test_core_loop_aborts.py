"""The core loop applies consecutive aborts as one call (each call rebuilds the scheduler's
queues: one by one, a disconnect storm cost the square of the queue), in order with the other
inputs, so an id's abort still comes before its re-add."""
import zmq

from kiln.core.core_loop import CoreLoop
from kiln.core.core_messages import AbortRequests, input_codec, to_wire
from kiln.core.request import Request
from kiln.sampling_params import SamplingParams


class RecordingCore:
    class executor:
        @staticmethod
        def rank_sentinels():
            return []

    def __init__(self):
        self.calls = []

    def add_request(self, request, child_ids=()):
        self.calls.append(("add", request.request_id))

    def abort_requests(self, req_ids):
        self.calls.append(("abort", list(req_ids)))


def test_consecutive_aborts_end_together_in_order_with_adds():
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://core-loop-aborts")
    push.connect("inproc://core-loop-aborts")
    out = ctx.socket(zmq.PUSH)
    try:
        core = RecordingCore()
        loop = CoreLoop(core, pull, out)
        encoder, _ = input_codec()

        def add(req_id):
            return to_wire(Request(req_id, [1, 2], SamplingParams(max_tokens=2)))

        for message in (add("a"), AbortRequests(["a"]), AbortRequests(["b", "c"]), add("a"),
                        AbortRequests(["d"]), AbortRequests(["e"])):
            push.send(encoder.encode(message))
        assert loop.drain(1000) is True
        assert core.calls == [("add", "a"), ("abort", ["a", "b", "c"]), ("add", "a"),
                              ("abort", ["d", "e"])]
        assert loop.inputs_handled == 6
    finally:
        for s in (pull, push, out):
            s.close(linger=0)
        ctx.term()


def test_a_failed_adds_report_counts_the_inputs_up_to_it_not_those_behind_it():
    """The client drops outputs of an id from before the core took its latest add (StepOutputs.
    inputs_handled). With add x (failing), abort x, add x in one batch, the failed add's abort
    report said all 3 inputs were handled: the client took it for the new x's end and lost x
    (the batch counted whole before any input was applied)."""
    from kiln.core.core_messages import StepOutputs, output_codec

    class FailingCore(RecordingCore):
        def add_request(self, request, child_ids=()):
            if not self.calls:  # the first one
                raise RuntimeError("the add fails")
            super().add_request(request, child_ids)

        def make_stats(self):
            from kiln.core.stats import SchedulerStats

            return SchedulerStats()

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    out_pull, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://core-loop-failed-add")
    push.connect("inproc://core-loop-failed-add")
    out_pull.bind("inproc://core-loop-failed-add-out")
    out.connect("inproc://core-loop-failed-add-out")
    try:
        core = FailingCore()
        loop = CoreLoop(core, pull, out)
        encoder, _ = input_codec()
        _, decoder = output_codec()
        add = to_wire(Request("x", [1, 2], SamplingParams(max_tokens=2)))
        for message in (add, AbortRequests(["x"]), add):
            push.send(encoder.encode(message))
        assert loop.drain(1000) is True
        report = decoder.decode(out_pull.recv())
        assert isinstance(report, StepOutputs) and report.outputs[0].finish_reason == "abort"
        assert report.inputs_handled == 1
        assert core.calls == [("abort", ["x"]), ("add", "x")] and loop.inputs_handled == 3
    finally:
        for s in (pull, push, out, out_pull):
            s.close(linger=0)
        ctx.term()
