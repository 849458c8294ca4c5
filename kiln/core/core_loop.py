"""The core's busy loop (`CoreLoop`): every waiting input applied between steps, each step's
outputs sent at once, a dead rank noticed while the core is idle."""
import time

import zmq

from kiln.core.core_messages import (
    UTILITY_METHODS,
    AbortRequests,
    EngineCoreRequest,
    FinishRequests,
    Shutdown,
    StepOutputs,
    UtilityCall,
    UtilityResult,
    failure_report,
    from_wire,
    input_codec,
    output_codec,
)
from kiln.core.request import RequestStatus
from kiln.logger import init_logger

logger = init_logger(__name__)

_IDLE_POLL_MS = 1000


def merged_aborts(messages: list) -> list[tuple[object, int]]:
    """The inputs in order, each run of consecutive AbortRequests as one: each abort call
    rebuilds the scheduler's queues, so a disconnect storm handled one by one cost the square
    of the queue (4,000 queued requests kept the core 7 s from stepping). Other inputs keep
    their place between them (an id's abort, then its re-add). Each with how many inputs it
    stands for, so inputs_handled counts only what was applied (an add's failure report)."""
    out: list[tuple[object, int]] = []
    for message in messages:
        if isinstance(message, AbortRequests) and out and isinstance(out[-1][0], AbortRequests):
            merged, count = out[-1]
            out[-1] = (AbortRequests(request_ids=[*merged.request_ids, *message.request_ids]),
                       count + 1)
        else:
            out.append((message, 1))
    return out


class CoreLoop:
    """The core's side of the queue: inputs in, step, outputs out."""

    def __init__(self, core, input_socket, output_socket):
        self.core = core
        self.input = input_socket
        self.output = output_socket
        self.encoder, _ = output_codec()
        _, self.decoder = input_codec()
        self.running = True
        self.inputs_handled = 0  # messages taken off the input socket (StepOutputs tells it)
        # An idle core steps no more, so no step would find a dead rank and the front end's
        # /health would stay 200 until the next request: the ranks' sentinels end the wait
        # instead (vLLM's worker monitor, with no thread to synchronize with the loop).
        self.poller = zmq.Poller()
        self.poller.register(self.input, zmq.POLLIN)
        self.rank_sentinels = core.executor.rank_sentinels()
        for sentinel in self.rank_sentinels:
            self.poller.register(sentinel, zmq.POLLIN)

    def send(self, message) -> None:
        self.output.send(self.encoder.encode(message), copy=False)

    def handle(self, message) -> bool:
        """Apply one input; True if it changed which requests the core holds."""
        core = self.core
        if isinstance(message, EngineCoreRequest):
            try:
                core.add_request(from_wire(message), message.child_ids)
            except Exception:  # noqa: BLE001 - report it as the request's end, keep serving
                logger.exception("request %s could not be added", message.request_id)
                ids = message.child_ids or [message.request_id]  # the ids the front end awaits
                self.send(StepOutputs(outputs=[_aborted(rid) for rid in ids],
                                      stats=core.make_stats(),
                                      inputs_handled=self.inputs_handled))
            return True
        if isinstance(message, AbortRequests):
            core.abort_requests(message.request_ids)
            return True
        if isinstance(message, FinishRequests):
            core.finish_requests(message.request_ids, RequestStatus(message.status))
            return True
        if isinstance(message, UtilityCall):
            if message.method not in UTILITY_METHODS:
                self.send(UtilityResult(message.call_id, error=f"no utility {message.method!r}"))
                return False
            try:
                result = self._utility(message)
            except Exception as e:  # noqa: BLE001 - the caller gets it
                self.send(UtilityResult(message.call_id, error=f"{type(e).__name__}: {e}",
                                        failure=failure_report(e)))
            else:
                self.send(UtilityResult(message.call_id, result=result))
            return False
        if isinstance(message, Shutdown):
            self.running = False
        return False

    def _utility(self, message: UtilityCall):
        if message.method == "collective_rpc":  # (method, args, kwargs) and results pickled
            from kiln.core import rpc_wire

            return rpc_wire.dumps_results(self.core.collective_rpc(
                *rpc_wire.loads(message.args[0])))
        return getattr(self.core, message.method)(*message.args)

    def drain(self, timeout_ms: int) -> bool:
        """Handle every waiting input (waiting up to `timeout_ms` for the first); raises
        WorkerFailedError once a rank has died."""
        changed = False
        events = dict(self.poller.poll(timeout_ms))
        if any(sentinel in events for sentinel in self.rank_sentinels):
            self.core.executor.check_health()
        if self.input not in events:
            return False
        messages = []
        while True:
            try:
                frame = self.input.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            messages.append(self.decoder.decode(frame.buffer))
        for message, count in merged_aborts(messages):
            if not self.running:  # a Shutdown came: what followed it is not served
                break
            # Counted before it is applied, only up to itself: an add that fails reports its
            # abort as of its own input, so the client does not take that report for a later
            # add of the same id behind it in this batch (core_client's _unfinished).
            self.inputs_handled += count
            changed |= self.handle(message)
        return changed

    def run(self) -> None:
        core = self.core
        check_every = core.executor.idle_check_s
        next_check = time.monotonic()
        while self.running:
            busy = core.has_work()  # a sleeping core's requests wait: it idles
            changed = self.drain(0 if busy else _IDLE_POLL_MS)
            if not self.running:
                break
            if not busy and check_every is not None and time.monotonic() >= next_check:
                core.executor.check_health()  # ranks without a sentinel: Ray's actors
                next_check = time.monotonic() + check_every
            if core.has_work():
                self.send(StepOutputs(outputs=core.step(), stats=core.make_stats(),
                                      inputs_handled=self.inputs_handled))
            elif changed:  # aborts freed blocks: the front's stats must show it
                self.send(StepOutputs(outputs=[], stats=core.make_stats(),
                                      inputs_handled=self.inputs_handled))


def _aborted(request_id: str):
    from kiln.core.outputs import EngineCoreOutput

    return EngineCoreOutput(request_id=request_id, new_token_ids=[], finish_reason="abort")
