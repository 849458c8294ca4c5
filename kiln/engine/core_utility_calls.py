"""`CoreUtilityCalls`, CoreProcClient's calls that wait for the core's answer: reset_prefix_cache,
the sleep mode, collective_rpc (with its timeout) and fresh stats, each one UtilityCall out."""
import math
import time

import msgspec

from kiln.core import rpc_wire
from kiln.core.core_messages import UtilityCall, UtilityResult
from kiln.core.stats import SchedulerStats
from kiln.engine.engine_sleep import rpc_timed_out


class _PastDeadline(Exception):
    """A core call's answer did not come by its deadline."""


class CoreUtilityCalls:
    """Reads what CoreProcClient.__init__ set up: `_call_ids`, `_num_sent`, `_last_stats`,
    `stats_inputs_handled`; sends with its `_send`, reads with `_recv` and `_take`."""

    def _call(self, method: str, *args, deadline: float | None = None):
        """The core's `method(*args)`; past `deadline` (time.monotonic()), _PastDeadline."""
        call_id = next(self._call_ids)
        self._send(UtilityCall(call_id=call_id, method=method, args=list(args)))
        while True:
            wait_ms = 1000
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _PastDeadline
                wait_ms = min(wait_ms, math.ceil(left * 1000))
            message = self._recv(wait_ms)
            if isinstance(message, UtilityResult) and message.call_id == call_id:
                if message.failure is not None:  # as its own kind: a bad argument's ValueError
                    raise rpc_wire.error_from(message.failure)
                if message.error is not None:
                    raise RuntimeError(f"engine core {method}: {message.error}")
                return message.result
            self._take(message)

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        return bool(self._call("reset_prefix_cache", reset_running_requests, reset_connector))

    # ---- sleep mode and collective_rpc (kiln/core/core_sleep.py) -----------------------------
    def sleep(self, level: int, mode: str) -> None:
        self._call("sleep", level, mode)

    def wake_up(self, tags: list[str] | None) -> None:
        self._call("wake_up", tags)

    def is_sleeping(self) -> bool:
        return bool(self._call("is_sleeping"))

    def sleep_status(self) -> dict:
        return self._call("sleep_status")

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list:
        """Pickled both ways (kiln/core/rpc_wire.py): tensors and results cross as they are.
        Past `timeout` s, TimeoutError: the core runs the call on (its late result is
        dropped: _take keeps step outputs only) and steps once it ends."""
        payload = rpc_wire.dumps_call(method, args, kwargs)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            return rpc_wire.loads(self._call("collective_rpc", payload, deadline=deadline))
        except _PastDeadline:
            raise rpc_timed_out(method, timeout) from None

    def make_stats(self) -> SchedulerStats:
        """Fresh stats: taken by the core after every message sent before this call."""
        self._last_stats = msgspec.convert(self._call("make_stats"), SchedulerStats)
        self.stats_inputs_handled = self._num_sent
        return self._last_stats
