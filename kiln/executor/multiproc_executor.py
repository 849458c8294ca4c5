"""`MultiprocExecutor`: one spawned worker process per rank on this machine, driven over pipes.

Each call is pickled once and its bytes written to every rank's pipe (the scheduler output's
delivery; its cost is measured). Replies are awaited together with the processes' sentinels, so
a rank that dies ends the call with an error naming it instead of a hang, and takes the others
down with it: after a rank fails, the executor is finished and every later call says why. A step
that some rank does not answer within KILN_EXECUTE_MODEL_TIMEOUT_SECONDS fails the same way, and
the engine core watches the sentinels between steps (`rank_sentinels`, `check_health`).
"""
import atexit
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
import weakref

from kiln import envs
from kiln.core.core_messages import failure_report
from kiln.distributed.model_split import check_parallel_split
from kiln.executor.abstract import RankFanOutExecutor
from kiln.executor.free_port import free_port
from kiln.executor.rank_errors import (
    STARTUP_TIMEOUT_S,
    WorkerFailedError,
    past,
    startup_error,
    unanswered_message,
    wait_slice,
)
from kiln.logger import init_logger
from kiln.process_signals import leave_group_signals_to_parent

logger = init_logger(__name__)

_JOIN_S = 5.0
# How long a rank's error waits for a peer's death to show: a killed rank's peers see its
# socket close (gloo: "Connection closed by peer") before the engine sees it gone.
_PEER_DEATH_S = 0.5


def _watch_parent(parent_pid: int) -> None:
    # A rank whose engine process is gone (killed, crashed) exits rather than linger forever.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def _rank_main(kiln_config, rank: int, world_size: int, init_method: str, conn,
               parent_pid: int, float32_matmul_precision: str | None = None) -> None:
    from kiln.executor.rank_worker import RankWorker

    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    leave_group_signals_to_parent(f"rank {rank}")  # the engine stops its ranks
    try:
        worker = RankWorker(kiln_config, rank, rank, world_size, init_method,
                            float32_matmul_precision)
    except BaseException as e:
        conn.send(("error", failure_report(e)))
        return
    conn.send(("ok", None))
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            break  # the engine closed its end
        if payload == b"shutdown":
            break
        try:
            reply = ("ok", worker.call_pickled(payload))
        except BaseException as e:
            reply = ("error", failure_report(e))
        try:
            conn.send(reply)
        except OSError:
            # The engine is gone mid-step (killed, or `kiln serve`'s third stop signal): a
            # BrokenPipeError traceback per rank was all this rank had to say.
            break
    worker.shutdown()


def _exit_description(code: int | None) -> str:
    if code is None:
        return "is unresponsive"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class MultiprocExecutor(RankFanOutExecutor):
    def __init__(self, kiln_config):
        super().__init__(kiln_config)
        check_parallel_split(kiln_config)
        pc = kiln_config.parallel_config
        self.world_size = pc.world_size
        self.step_timeout_s = envs.execute_model_timeout_s()  # checked before any rank starts
        self.failure: str | None = None
        self.procs: list = []
        self.conns: list = []
        self.broadcast_seconds = 0.0
        self.broadcast_calls = 0
        ctx = multiprocessing.get_context("spawn")
        import torch

        precision = torch.get_float32_matmul_precision()  # a spawned rank starts at torch's
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self._finalizer = weakref.finalize(self, MultiprocExecutor._kill_all, self.procs,
                                           os.getpid())
        atexit.register(self._finalizer)
        for rank in range(self.world_size):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=_rank_main, name=f"kiln-rank-{rank}", daemon=False,
                               args=(kiln_config, rank, self.world_size, init_method, child,
                                     os.getpid(), precision))
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        try:
            self._collect(timeout=STARTUP_TIMEOUT_S, what="start-up")
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d ranks started (tensor_parallel_size=%d, pipeline_parallel_size=%d)",
                    self.world_size, pc.tensor_parallel_size, pc.pipeline_parallel_size)

    # ---- calls ---------------------------------------------------------------------------
    def _stop(self, message: str, level: int = logging.ERROR) -> None:
        """Stop every rank and refuse later calls with `message`."""
        self.failure = message
        logger.log(level, "%s; stopping every rank", message)
        # The others may wait in a collective for the failed rank forever: no grace period.
        self._kill_all(self.procs)
        self.shutdown()

    def _fail(self, message: str) -> None:
        self._stop(message)
        raise WorkerFailedError(message)

    def _collect(self, timeout: float | None, what: str) -> list:
        """Every rank's reply, in rank order; raises naming the first rank that died or raised."""
        replies: dict[int, object] = {}
        by_conn = {conn: r for r, conn in enumerate(self.conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self.procs)}
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(replies) < self.world_size:
            waiting = [c for c, r in by_conn.items() if r not in replies]
            sentinels = [s for s, r in by_sentinel.items() if r not in replies]
            ready = multiprocessing.connection.wait(waiting + sentinels,
                                                    timeout=wait_slice(deadline))
            if not ready and not past(deadline):
                continue  # one slice of a very long timeout
            if not ready:
                self._fail(unanswered_message(
                    what, sorted(set(range(self.world_size)) - set(replies)), timeout,
                    {rank: proc.pid for rank, proc in enumerate(self.procs)}))
            for obj in ready:
                if obj in by_conn:
                    rank = by_conn[obj]
                    try:
                        status, value = obj.recv()
                    except (EOFError, OSError):
                        continue  # its sentinel says how it ended
                    if status == "error":
                        # A collective fails in every rank when one dies: name the dead one
                        dead = self._dead_rank(_PEER_DEATH_S, besides=rank)
                        if dead is not None:
                            self._fail_dead(dead, f"during {what}")
                        error = startup_error(value, rank, what)
                        if error is not None:  # the user's to fix, in one line (rank_errors.py)
                            self._stop(f"worker rank {rank} failed during {what}: {error}",
                                       logging.DEBUG)
                            raise error
                        self._fail(f"worker rank {rank} failed during {what}:\n"
                                   f"{value.traceback}")
                    replies[rank] = value
                elif by_sentinel[obj] not in replies:
                    self._fail_dead(by_sentinel[obj], f"during {what}")
        return [replies[r] for r in range(self.world_size)]

    def _dead_rank(self, wait_s: float, besides: int | None = None) -> int | None:
        """A rank whose process has ended (waiting up to `wait_s` for one), else None.
        `besides`: a rank that reported an error: another's death only counts if it died of a
        signal or an error (a rank that reported its own error then exits cleanly)."""
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs) if r != besides}
        for sentinel in multiprocessing.connection.wait(list(sentinels), timeout=wait_s):
            rank = sentinels[sentinel]
            self.procs[rank].join(0.1)
            if besides is None or self.procs[rank].exitcode != 0:
                return rank
        return None

    def _fail_dead(self, rank: int, when: str) -> None:
        proc = self.procs[rank]
        proc.join(0.1)
        self._fail(f"worker rank {rank} (pid {proc.pid}) {_exit_description(proc.exitcode)} "
                   f"{when}")

    def rank_sentinels(self) -> list[int]:
        return [proc.sentinel for proc in self.procs]

    def check_health(self) -> None:
        if self.failure is not None:
            raise WorkerFailedError(f"the engine's workers are gone: {self.failure}")
        dead = self._dead_rank(0)
        if dead is not None:
            self._fail_dead(dead, "between steps")

    def _run_on_all(self, method: str, *args) -> list:
        if self.failure is not None:
            raise WorkerFailedError(f"the engine's workers are gone: {self.failure}")
        start = time.perf_counter()
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            try:
                for conn in self.conns:
                    conn.send_bytes(payload)
            except (BrokenPipeError, OSError):
                pass  # a dead rank: _collect names it
            if method == "execute_model":
                self.broadcast_seconds += time.perf_counter() - start
                self.broadcast_calls += 1
            timeout = self.step_timeout_s if method == "execute_model" else None
            return self._collect(timeout=timeout, what=method)
        except BaseException as e:
            if self.failure is None:  # interrupted (Ctrl-C) between a send and its replies
                # Some ranks may have the call and unread replies may wait in the pipes: a
                # next call would read this one's replies as its own, a step behind, or hang.
                self._stop(f"{method} was interrupted ({type(e).__name__}) before every rank "
                           "answered; create a new engine")
            raise

    # ---- shutdown ------------------------------------------------------------------------
    @staticmethod
    def _kill_all(procs: list, owner_pid: int | None = None) -> None:
        if owner_pid is not None and os.getpid() != owner_pid:
            return  # the finalizer at a forked child's exit: the ranks are its parent's
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(_JOIN_S)

    def shutdown(self) -> None:
        for conn in self.conns:
            try:
                conn.send_bytes(b"shutdown")
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + _JOIN_S
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                # Stuck in a collective with a dead peer, most likely: it cannot finish.
                proc.kill()
                proc.join(_JOIN_S)
        for conn in self.conns:
            conn.close()
        self.conns.clear()
        self._finalizer.detach()
