"""`CoreReceiver`, CoreProcClient's receiving half: the core's messages read off its output
socket, and its death learned (its own failure report, or its exit seen on the pidfd) and told.
"""
import select
import threading
import time
import weakref

import zmq

from kiln.core.core_messages import CoreFailed, StepOutputs
from kiln.engine.core_errors import EngineCoreDeadError, rebuild_error
from kiln.engine.core_proc_exit import exit_error, wait_briefly, watch_exit
from kiln.logger import init_logger

logger = init_logger(__name__)

# How long the exit watcher waits for the failure report a failing core sends before it exits (read
# by the caller's wait for outputs, or by the watcher where nobody waits: an idle server), so death
# callbacks hear the named error (a rank that died), not only an exit code.
_FAILURE_REPORT_WAIT_S = 1.0


class CoreReceiver:
    """Reads what CoreProcClient.__init__ set up: `proc`, `pid`, `_output`, `_decoder`,
    `_poller` (output socket and pidfd), `_sentinel` (the pidfd), `_reading`, `_dead`,
    `_failure_reported`, `_death_callbacks`, `_closing`, `_pending`, `_watched`."""

    def _watch(self) -> None:
        """Start the thread that reaps the process and runs on_exit once it has exited."""
        threading.Thread(target=watch_exit, args=(weakref.ref(self), self.proc),
                         name="kiln-core-watch", daemon=True).start()
        self._watched = True

    def _exited(self) -> bool:
        """From the pidfd: Popen.poll() says None while the watcher thread reaps the process."""
        return bool(select.select([self._sentinel], [], [], 0)[0])

    def _gone(self) -> EngineCoreDeadError:
        """What a call raises once the core is known dead: the failure's own kind went to the
        call that read it; every later one says the engine is gone, naming the failure, so a
        caller tells it from a bad request (the core's ValueError read as a 400 on the prompt,
        its RuntimeError as a 500)."""
        if isinstance(self._dead, EngineCoreDeadError):
            return self._dead
        error = EngineCoreDeadError(f"the engine core failed: {self._dead}; requests in flight "
                                    "are lost: restart the engine")
        error.__cause__ = self._dead
        return error

    def _recv(self, timeout_ms: int):
        """The next message from the core, None after `timeout_ms`; raises once the core died."""
        with self._reading:
            if self._dead is not None:  # perhaps read by the exit watcher while we waited
                raise self._gone()
            events = dict(self._poller.poll(timeout_ms))
            if self._output in events:
                message = self._read_output()
                if isinstance(message, CoreFailed):
                    wait_briefly(self.proc, 5)
                    raise self._dead
                return message
            if self._sentinel in events:
                self._dead = exit_error(self.proc)
                raise self._dead
        return None

    def _read_output(self):
        """One message from the output socket (the caller holds `_reading`); a CoreFailed is
        noted as the client's death."""
        message = self._decoder.decode(self._output.recv(copy=False).buffer)
        if isinstance(message, CoreFailed):
            self._dead = rebuild_error(message)
            self._failure_reported.set()
        return message

    def _read_failure_report(self) -> bool:
        """Whether the exited core's own report of its failure arrived (waits for it)."""
        deadline = time.monotonic() + _FAILURE_REPORT_WAIT_S
        if not self._reading.acquire(timeout=_FAILURE_REPORT_WAIT_S):
            return self._failure_reported.is_set()
        try:  # nobody else reads: what the core sent last is read here
            while not self._failure_reported.is_set():
                left_ms = max(0, int((deadline - time.monotonic()) * 1000))
                if not self._output.poll(left_ms):
                    break
                self._take(self._read_output())
        except zmq.ZMQError:
            pass  # the front end is shutting down too (a signal to the whole group): closed
        finally:
            self._reading.release()
        return self._failure_reported.is_set()

    def on_exit(self) -> None:
        """Run by watch_exit once the process has exited: tells the death callbacks, unless we
        stopped it."""
        if self._closing.is_set():
            return
        logger.error("the engine core process (pid %d) exited with code %s", self.pid,
                     self.proc.returncode)
        # Only a core that exited by itself can have sent its own report (a killed one: no wait).
        exited_itself = self.proc.returncode is not None and self.proc.returncode >= 0
        reported = self._failure_reported.is_set() or (
            exited_itself and self._read_failure_report())
        error = self._dead if reported else exit_error(self.proc)
        for callback in list(self._death_callbacks):
            try:
                callback(error)
            except Exception:  # noqa: BLE001 - one callback must not stop the others
                logger.exception("engine core death callback failed")

    def add_death_callback(self, callback) -> None:
        """`callback(error)` runs on a watcher thread when the core process exits unasked."""
        self._death_callbacks.append(callback)

    def _take(self, message) -> None:
        if isinstance(message, StepOutputs):
            self._pending.append(message)
