"""`Requeueing`: the Scheduler's paths that give requests' KV blocks back and requeue them to be
recomputed: preemption when the cache runs out, a failed step undone, the prefix cache reset.
"""
from kiln.core.outputs import SchedulerOutput
from kiln.core.request import Request, RequestStatus
from kiln.core.request_queue import preemption_victim
from kiln.logger import init_logger

logger = init_logger(__name__)


class Requeueing:
    """Mixed into `Scheduler` (scheduler.py), whose state and helpers these methods use."""

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached block hash (stale after new weights); False while requests hold
        blocks, unless `reset_running_requests` requeues them first, to be recomputed (vLLM's)."""
        if reset_running_requests:
            # Preempted as in vLLM, which counts them: their K/V is recomputed like any victim's.
            for request in self.running:
                request.num_preemptions += 1
            self.num_preemptions += len(self.running)
            self._undo(dict.fromkeys(r.request_id for r in self.running))
        if self.kv_cache_manager.reset_prefix_cache():
            return True
        logger.warning("prefix cache not reset: running requests hold KV blocks "
                       "(reset_running_requests=True requeues them)")
        return False

    def _allocate_or_preempt(self, request: Request, num_new: int,
                             num_lookahead: int = 0) -> list[int] | None:
        """Allocate for a running request, preempting lower-priority ones until it fits.

        Returns the new block ids, or None when `request` itself was preempted or ended.
        """
        kv = self.kv_cache_manager
        while True:
            new_block_ids = kv.allocate_slots(request, num_new,
                                              num_lookahead_tokens=num_lookahead)
            if new_block_ids is not None:
                return new_block_ids
            # Running is in the policy's order: the victim was not scheduled yet (or is `request`).
            victim = preemption_victim(self.running, self._key)
            self.running = [r for r in self.running if r is not victim]
            if victim is not request:
                self._preempt(victim)
                continue
            needed = request.num_computed_tokens + num_new
            if kv.num_blocks_held(request.num_computed_tokens,
                                  needed + num_lookahead) > kv.num_blocks:
                self._finish_unschedulable(request, needed)
            else:
                self._preempt(request)
            return None

    def undo_step(self, scheduler_output: SchedulerOutput) -> None:
        """The step's forward raised (Ctrl-C in LLM.generate, a failed kernel): nothing it
        scheduled was computed, so its requests go back to the front of the queue and are
        computed again from scratch, as after a preemption, and a caller that goes on stepping
        gets the same tokens as without the failure."""
        self._undo(scheduler_output.num_scheduled_tokens)

    def _undo(self, num_scheduled: dict[str, int]) -> None:
        scheduled = {id(r) for r in map(self.requests.get, num_scheduled) if r is not None}
        undone = [r for r in self.running if id(r) in scheduled]
        self.running = [r for r in self.running if id(r) not in scheduled]
        # Latest first onto the front of the queue: the earliest ends up first again.
        for request in sorted(undone, key=self._key, reverse=True):
            self._requeue(request)

    def _preempt(self, request: Request) -> None:
        self._requeue(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        logger.info("preempted request %s (KV cache full; it will be recomputed); "
                    "%d preemptions so far", request.request_id, self.num_preemptions)

    def _requeue(self, request: Request) -> None:
        """Back to the front of the queue with its blocks freed, to be recomputed; the runner
        is told to drop its state (it re-adds the request when it is scheduled again)."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []  # proposed after tokens it will compute again
        self.waiting.prepend(request)
        self.preempted_req_ids.add(request.request_id)
        self.finished_req_ids.add(request.request_id)
