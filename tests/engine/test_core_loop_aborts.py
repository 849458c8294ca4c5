"""The core loop applies consecutive aborts as one call (each call rebuilds the scheduler's
queues: one by one, a disconnect storm cost the square of the queue), in order with the other
inputs, so an id's abort still comes before its re-add."""
import zmq

from kiln.core.core_messages import AbortRequests, input_codec, to_wire
from kiln.core.core_process import CoreLoop
from kiln.core.request import Request
from kiln.sampling_params import SamplingParams


class RecordingCore:
    class executor:
        @staticmethod
        def rank_sentinels():
            return []

    def __init__(self):
        self.calls = []

    def add_request(self, request):
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
