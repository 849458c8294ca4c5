"""The scheduler's policy (vLLM's --scheduling-policy): the order of its queues and whom a full
KV cache preempts. Pure: keys and choices over requests, no cache or model.

- fcfs (the default): requests in arrival order; a request's priority is accepted and ignored,
  as vLLM V1 does (its FCFS queue never reads it).
- priority: a lower `priority` value is served first, ties by arrival (vLLM V1's
  (priority, arrival_time) order). Running requests are kept in that order too, so a full cache
  preempts the running request with the largest (priority, arrival) - vLLM's victim - and the
  step's token budget goes to the most urgent requests first. As in vLLM V1, a waiting request
  never preempts a running one: it waits for blocks to free.
"""
import bisect
from collections import deque
from collections.abc import Callable, Iterable, Iterator

from kiln.core.request import Request
from kiln.wire_ints import INT64_MAX, INT64_MIN

POLICIES = ("fcfs", "priority")

# Request -> a sort key; the scheduler adds its own arrival counter as the last tiebreak.
OrderKey = tuple


def check_priority(priority) -> None:
    """A request's priority: any int that crosses to the core process (msgpack's int64)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an int, got {priority!r}")
    if not INT64_MIN <= priority <= INT64_MAX:
        raise ValueError(f"priority must be within a 64-bit integer's range, got {priority}")


def order_key(policy: str, request: Request, seq: int) -> OrderKey:
    """Where `request` (the `seq`-th added) stands: smaller runs first."""
    if policy == "priority":
        return (request.priority, request.arrival_time, seq)
    return (request.arrival_time, seq)


def preemption_victim(running: list[Request], key: Callable[[Request], OrderKey]) -> Request:
    """The running request a full KV cache gives up first: the one that stands last."""
    return max(running, key=key)


class WaitingQueue:
    """The waiting requests. fcfs: a deque (new ones at the back, preempted and passed-by ones
    back at the front). priority: kept sorted by `key`, so "the front" is wherever a request's
    key puts it (vLLM's PriorityRequestQueue: a preempted request is re-added, not prepended)."""

    def __init__(self, policy: str, key: Callable[[Request], OrderKey]):
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; --scheduling-policy takes "
                             f"one of {', '.join(POLICIES)}")
        self.sorted = policy == "priority"
        self._key = key
        self._items: deque[Request] | list[Request] = [] if self.sorted else deque()

    def add(self, request: Request) -> None:
        if self.sorted:
            bisect.insort(self._items, request, key=self._key)
        else:
            self._items.append(request)

    def prepend(self, request: Request) -> None:
        if self.sorted:
            self.add(request)
        else:
            self._items.appendleft(request)

    def prepend_all(self, requests: Iterable[Request]) -> None:
        """Back at the front in their given order (fcfs), or by key (priority)."""
        for request in reversed(list(requests)):
            self.prepend(request)

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        return self._items.pop(0) if self.sorted else self._items.popleft()

    def remove_all(self, ids: set[int]) -> None:
        """Drop the requests whose id() is in `ids` (order kept)."""
        kept = [r for r in self._items if id(r) not in ids]
        self._items = kept if self.sorted else deque(kept)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)
