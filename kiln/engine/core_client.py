"""The engine front's handle on the engine core in its own process, over ZeroMQ.

LLMEngine picks it or the in-process one (inproc_core_client.py) by
`KILN_ENABLE_V1_MULTIPROCESSING` (as vLLM's); both offer EngineCore's add / abort / finish / step
calls, so the engine front drives either the same way.
"""
import collections
import itertools
import os
import select
import shutil
import tempfile
import threading
import weakref
from collections.abc import Sequence

import zmq

from kiln.core.core_messages import (
    AbortRequests,
    FinishRequests,
    Ready,
    Shutdown,
    StepOutputs,
    input_codec,
    output_codec,
    to_wire,
)
from kiln.core.outputs import EngineCoreOutput
from kiln.core.request import Request, RequestStatus
from kiln.core.stats import SchedulerStats
from kiln.engine.core_interpreter import CoreInterpreter
from kiln.engine.core_proc_exit import exit_error, terminate
from kiln.engine.core_receiver import CoreReceiver
from kiln.engine.core_utility_calls import CoreUtilityCalls
from kiln.logger import init_logger
from kiln.process_signals import stops_deferred

logger = init_logger(__name__)

# How long one wait for the core's outputs lasts before the caller gets control back (to queue
# an add or an abort); the core's death ends any wait at once.
_STEP_WAIT_MS = 50
_SHUTDOWN_WAIT_S = 10.0


def _wait_s(timeout: float | None) -> float:
    return _SHUTDOWN_WAIT_S if timeout is None else max(0.0, float(timeout))


class CoreProcClient(CoreUtilityCalls, CoreReceiver):
    """The core in its own process. Requests go out on one PUSH socket, outputs come back on
    one PULL socket; the process sentinel is polled with it, so a dead core ends every wait
    (reading them and learning of the core's death: CoreReceiver)."""

    def __init__(self, kiln_config, executor_class: type,
                 interpreter: "CoreInterpreter | None" = None, front_end_cores: int = 0):
        """`interpreter`: one started earlier (else it starts now). `front_end_cores`: cores
        the core's CPU threads leave to this process once warm (core_process._leave_cores)."""
        self._kiln_config = kiln_config
        self._encoder, _ = input_codec()
        _, self._decoder = output_codec()
        # mkdtemp, removed by _terminate: a TemporaryDirectory's own exit hook would also run in
        # a forked child, removing this process's sockets' directory.
        self._dir = tempfile.mkdtemp(prefix="kiln-core-")
        try:  # a SIGTERM (or any error) before the core knows the directory: nobody else would
            self._connect_and_start(kiln_config, executor_class, interpreter, front_end_cores)
        except BaseException:
            if hasattr(self, "proc") and not hasattr(self, "_finalizer"):
                self.proc.kill()  # started, but nothing would stop it
            if hasattr(self, "_ctx"):
                self._ctx.destroy(linger=0)
            shutil.rmtree(self._dir, ignore_errors=True)
            raise

    def _connect_and_start(self, kiln_config, executor_class: type,
                           interpreter: "CoreInterpreter | None", front_end_cores: int) -> None:
        with stops_deferred():  # a SystemExit inside socket() hung the error path's destroy()
            self._ctx = zmq.Context()
            self._input = self._ctx.socket(zmq.PUSH)
            self._input.setsockopt(zmq.LINGER, 0)
            self._output = self._ctx.socket(zmq.PULL)
            self._output.setsockopt(zmq.LINGER, 0)
        input_address = f"ipc://{self._dir}/input"
        output_address = f"ipc://{self._dir}/output"
        self._input.bind(input_address)
        self._output.bind(output_address)
        self._pending: collections.deque[StepOutputs] = collections.deque()
        # Core request id -> how many messages had been sent once its add was: the core runs
        # ahead, so outputs of an aborted (or stop-string-ended) request can arrive after the
        # caller reused its id; those from before the core took the new add are dropped.
        self._unfinished: dict[str, int] = {}
        self._num_sent = 0
        self.stats_inputs_handled = 0  # messages the core had taken when `_last_stats` was made
        self._last_stats = SchedulerStats()
        self._call_ids = itertools.count()
        # Told by Ready: the KV cache's size in blocks, and the config's max_model_len or the
        # lower one the cache holds.
        self.num_blocks: int | None = None
        self.max_model_len: int | None = None
        self.num_threads: int | None = None  # torch's threads in the core, told by Ready
        self._dead: BaseException | None = None
        self._failure_reported = threading.Event()  # set once a CoreFailed was read
        # zmq sockets are not thread-safe: the caller's thread reads outputs, and the exit watcher
        # reads the core's last report where that thread is not reading (an idle server).
        self._reading = threading.Lock()
        self._death_callbacks: list = []
        self._closing = threading.Event()  # set when we stop the process: no death to report
        # A fresh interpreter, not fork (the caller may hold OpenMP threads, CUDA, or the
        # tokenizer's pool) and not multiprocessing's spawn (it re-runs an unguarded script).
        interpreter = interpreter or CoreInterpreter()
        self.proc = interpreter.start(kiln_config, executor_class, input_address,
                                      output_address, front_end_cores)
        self.pid = self.proc.pid
        # Readable once the process has exited: polled beside the output socket.
        self._sentinel = os.pidfd_open(self.pid)
        # Readable once the core is past its last act (core_interpreter.py); set when shutdown
        # saw it, so the kernel's teardown of the core's memory is not waited for.
        self._goodbye = interpreter.goodbye
        self._said_goodbye = threading.Event()
        self._watched = False  # a watcher thread reaps the process
        self._owner_pid = os.getpid()
        self._finalizer = weakref.finalize(self, terminate, self._owner_pid, self.proc, self._ctx,
                                           self._dir, self._sentinel, self._closing,
                                           self._goodbye, self._said_goodbye)
        self._poller = zmq.Poller()
        self._poller.register(self._output, zmq.POLLIN)
        self._poller.register(self._sentinel, zmq.POLLIN)
        self._send_poller = zmq.Poller()  # room in the input queue, or the core's exit
        self._send_poller.register(self._input, zmq.POLLOUT)
        self._send_poller.register(self._sentinel, zmq.POLLIN)

    def wait_until_ready(self) -> None:
        """Block until the core built its engine (raising what it raised if it could not)."""
        try:
            while True:
                message = self._recv(1000)
                if isinstance(message, Ready):
                    break
        except BaseException:
            self.shutdown()
            raise
        self.startup_timings = dict(message.timings)
        self.num_blocks = message.num_blocks
        self.max_model_len = message.max_model_len
        self.num_threads = message.num_threads
        self._watch()
        logger.info("engine core running in process %d", self.pid)

    # ---- EngineCore's calls ------------------------------------------------------------------
    def _send(self, message) -> None:
        data = self._encoder.encode(message)
        while True:
            if self._dead is not None:
                raise self._gone()
            if self._exited():
                self._dead = exit_error(self.proc)
                raise self._dead
            try:
                self._input.send(data, flags=zmq.NOBLOCK, copy=False)
                self._num_sent += 1
                return
            except zmq.Again:
                # No core takes it: one on its way out closed its socket (a blocking send then
                # waited forever, the core long gone), or one in a long step has a full queue.
                self._send_poller.poll(_STEP_WAIT_MS)

    def add_request(self, request: Request, child_ids: Sequence[str] = ()) -> None:
        """`child_ids`: an n > 1 request's samples, which the core makes (EngineCore.add_request):
        one message carries the params the samples share."""
        self._send(to_wire(request, child_ids))
        for req_id in child_ids or [request.request_id]:
            self._unfinished[req_id] = self._num_sent

    def abort_requests(self, req_ids: list[str]) -> None:
        req_ids = [req_ids] if isinstance(req_ids, str) else list(req_ids)
        self._forget(req_ids)
        self._send(AbortRequests(request_ids=req_ids))

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> None:
        req_ids = [req_ids] if isinstance(req_ids, str) else list(req_ids)
        self._forget(req_ids)
        self._send(FinishRequests(request_ids=req_ids, status=int(status)))

    def _forget(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self._unfinished.pop(req_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def owns(self, req_id: str) -> bool:
        """Whether `req_id` (a core request id) is unfinished in this core."""
        return req_id in self._unfinished

    @property
    def num_unfinished(self) -> int:
        return len(self._unfinished)

    @property
    def num_sent(self) -> int:
        """Messages sent to the core so far (StepOutputs.inputs_handled counts the same)."""
        return self._num_sent

    def step(self, wait_ms: int = _STEP_WAIT_MS) -> list[list[EngineCoreOutput]]:
        """Outputs of every core step since the last call, one list per core step (a core
        that ran ahead sent several: the step metrics observe each apart), waiting up to
        `wait_ms` for one ([] then: the caller may queue work and call again)."""
        if not self._pending:
            message = self._recv(wait_ms)
            self._take(message)
        while True:  # catch up: take every message already here
            message = self._recv(0)
            if message is None:
                break
            self._take(message)
        steps: list[list[EngineCoreOutput]] = []
        while self._pending:
            message = self._pending.popleft()
            outputs = [out for out in message.outputs
                       if self._unfinished.get(out.request_id, 0) <= message.inputs_handled]
            steps.append(outputs)
            self._last_stats = message.stats
            self.stats_inputs_handled = message.inputs_handled
            for out in outputs:
                if out.finished:
                    self._unfinished.pop(out.request_id, None)
        return steps

    def step_stats(self) -> SchedulerStats:
        """The stats that came with the latest step (no round trip)."""
        return self._last_stats

    def shutdown(self, timeout: float | None = None) -> None:
        """`timeout`: how long the core gets to say goodbye and exit (None: 10 s); after it,
        it is signalled, then killed (core_proc_exit.terminate)."""
        if not self._finalizer.alive:
            return  # already shut down
        if os.getpid() != self._owner_pid:
            return  # a forked child: the core is its parent's (a message would wait 10 s unsent)
        self._closing.set()
        if not self._exited() and self._dead is None:
            # A core still starting up (no Ready yet) reads no message until its model is
            # loaded: the finalizer stops it rather than wait (a blocking send waited forever).
            told = False
            if self.num_blocks is not None:
                try:
                    self._input.send(self._encoder.encode(Shutdown()), flags=zmq.NOBLOCK,
                                     copy=False)
                    told = True
                except zmq.ZMQError:
                    pass
            ready, _, _ = select.select([self._goodbye, self._sentinel], [], [],
                                        _wait_s(timeout) if told else 0)
            if self._goodbye in ready:
                self._said_goodbye.set()
                if not self._watched:  # someone must reap it
                    self._watch()
        self._finalizer()

