"""`SchedulerRequests`: requests into and out of the Scheduler: added (checked, ordered by the
policy, a grammar set compiling), ended from outside or by the scheduler, their blocks released."""
from collections.abc import Iterable

from kiln.core.request import Request, RequestStatus
from kiln.core.request_progress import grammar_error_output, unschedulable_output
from kiln.core.request_queue import order_key


class SchedulerRequests:
    """Mixed into `Scheduler` (scheduler.py), whose state (`requests`, `waiting`, `running`,
    `_order`, the KV cache manager, the forget-lists) these methods keep."""

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if not request.prompt_token_ids:
            # Nothing to compute means no logits to sample from: it would sit running forever.
            raise ValueError(f"request {request.request_id!r} has an empty prompt_token_ids; "
                             "give at least one token")
        if request.sampling_params.structured_outputs is not None:
            # Compiles on the manager's threads; schedule() passes the request by until then.
            self.structured_output_manager.grammar_init(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._order[request.request_id] = order_key(self.policy, request, next(self._arrival_counter))
        self.waiting.add(request)

    def finish_requests(self, req_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """End requests from outside (abort, stop string); unknown or finished ids are ignored."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finished_status must be a FINISHED_* status, got {finished_status!r}")
        if isinstance(req_ids, str):
            req_ids = [req_ids]
        ending = [self.requests[r] for r in set(req_ids) if r in self.requests]
        if not ending:
            return
        gone = {id(r) for r in ending}
        self.running = [r for r in self.running if id(r) not in gone]
        self.waiting.remove_all(gone)
        for request in ending:
            request.status = finished_status
            self._release(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def wait_for_grammars(self, timeout: float) -> None:
        """After a step with nothing to run: wait (up to `timeout` s) for a grammar still
        compiling, instead of spinning on empty steps."""
        for request in self.waiting:
            grammar = request.structured_output_request
            if grammar is not None and not grammar.is_ready():
                grammar.wait(timeout)
                return

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def _finish_unschedulable(self, request: Request, num_tokens: int) -> None:
        self._finished_outputs.append(unschedulable_output(
            request, num_tokens, self.kv_cache_manager, self.max_model_len,
            self.larger_cache_flags))
        self._release(request)

    def _finish_grammar_error(self, request: Request) -> None:
        self._finished_outputs.append(grammar_error_output(request))
        self._release(request)

    def _release(self, request: Request) -> None:
        """Forget a finished request (already off the queues): blocks back, runner told."""
        self.kv_cache_manager.free(request)
        self.requests.pop(request.request_id, None)
        self._order.pop(request.request_id, None)
        # A finished request is forgotten for good, not parked as a preempted one would be.
        self.preempted_req_ids.discard(request.request_id)
        self.finished_req_ids.add(request.request_id)
