"""`Scheduler`: picks, each step, which requests run and how many of their tokens.

A per-step token budget, chunked prefill, running requests before waiting ones, and preemption
by recompute when the KV cache runs out of blocks; --scheduling-policy (request_queue.py) orders
the queues and picks the preempted: arrival order (fcfs) or (priority, arrival) (priority);
preemption, a failed step undone and the prefix cache reset requeue requests (requeueing.py).
"""
import bisect
import itertools
import time
from collections import deque

from kiln.core.kv_cache_groups import group_peak_blocks, kv_cache_groups_of
from kiln.core.kv_cache_manager import KVCacheManager
from kiln.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from kiln.core.request import Request, RequestStatus
from kiln.core.request_progress import step_output
from kiln.core.request_queue import WaitingQueue
from kiln.core.requeueing import Requeueing
from kiln.core.scheduler_requests import SchedulerRequests
from kiln.core.stats import SchedulerStats, spec_decode_stats
from kiln.lora.scheduling import fits_lora_slots, lora_stats, starves
from kiln.spec_decode.scheduling import SpecDecodeScheduling, max_lookahead
from kiln.structured_output.manager import StructuredOutputManager


class Scheduler(SchedulerRequests, Requeueing):
    def __init__(self, kiln_config, num_blocks: int, max_model_len: int | None = None):
        """`num_blocks`: the KV cache's size in blocks, as the engine core settled it;
        `max_model_len`: the length it settled (below the config's where the cache caps it)."""
        sched, cache = kiln_config.scheduler_config, kiln_config.cache_config
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"the Scheduler needs the KV cache's block count (>= 1; EngineCore "
                             f"sizes the cache); got num_blocks={num_blocks!r}")
        self.max_num_seqs = sched.max_num_seqs
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        self.chunked_prefill = sched.enable_chunked_prefill
        self.max_model_len = max_model_len or sched.max_model_len
        spec = kiln_config.speculative_config
        self.kv_cache_manager = KVCacheManager(
            cache.block_size, num_blocks, cache.enable_prefix_caching,
            group_windows=kv_cache_groups_of(kiln_config).windows,
            use_eagle=spec is not None and spec.is_eagle)
        self.larger_cache_flags = cache.larger_cache_flags()  # named when a request is cut
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.policy = sched.policy
        self.waiting = WaitingQueue(self.policy, self._key)
        self.running: list[Request] = []  # kept in the policy's order: the last goes first
        # Ids the runner must forget, reported in the next SchedulerOutput.
        self.finished_req_ids: set[str] = set()
        self.preempted_req_ids: set[str] = set()
        # Requests the scheduler itself ended while scheduling (too long for the cache).
        self._finished_outputs: list[EngineCoreOutput] = []
        self._order: dict[str, tuple] = {}  # request id -> order_key()
        self._arrival_counter = itertools.count()
        self.num_preemptions = 0
        self.structured_output_manager = StructuredOutputManager(kiln_config)
        self.spec_decode = SpecDecodeScheduling(spec) if spec is not None else None
        self.max_lookahead = max_lookahead(spec)
        # Adapters running requests use at most (kiln/lora/scheduling.py); None: no LoRA.
        lora = getattr(kiln_config, "lora_config", None)
        self.max_loras = None if lora is None else lora.max_loras

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        kv = self.kv_cache_manager
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        cached = CachedRequestData()
        new_reqs: list[NewRequestData] = []
        preemptions_before = self.num_preemptions
        spec_tokens: dict[str, list[int]] = {}

        # Running requests first, in priority order: decodes take 1 token, prefills a chunk.
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            drafts = (self.spec_decode.drafts(request, budget, self.max_model_len)
                      if self.spec_decode is not None else [])
            num_new = min(request.num_tokens - request.num_computed_tokens + len(drafts), budget)
            new_block_ids = self._allocate_or_preempt(
                request, num_new, self._lookahead(request, request.num_computed_tokens, num_new))
            if new_block_ids is None:
                break  # `request` was the last running one and had to go
            if drafts:
                spec_tokens[request.request_id] = drafts
            cached.req_ids.append(request.request_id)
            cached.new_block_ids.append(new_block_ids)
            if kv.num_groups > 1:
                cached.new_group_block_ids.append(
                    kv.other_group_block_ids(request.request_id, len(new_block_ids)))
            cached.num_computed_tokens.append(request.num_computed_tokens)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            index += 1

        # Then waiting ones in the queue's order; after a preemption the cache is too tight to
        # admit. A request whose grammar is still compiling, or whose LoRA adapter has no free
        # slot, keeps its place but lets later ones by. Chunked prefill off, a prompt that does
        # not fit what is left of the budget ends the step's admissions (vLLM V1's): letting
        # shorter ones by would starve it behind a steady stream of them.
        held: deque[Request] = deque()
        lora_starving = False  # one waited too long for a LoRA slot (kiln/lora/scheduling.py)
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and self.num_preemptions == preemptions_before):
            request = self.waiting.peek()
            grammar = request.structured_output_request
            if grammar is not None and not grammar.is_ready():
                held.append(self.waiting.pop())
                continue
            if grammar is not None and grammar.error is not None:
                self.waiting.pop()
                self._finish_grammar_error(request)
                continue
            if not fits_lora_slots(request, self.running, self.max_loras, lora_starving):
                lora_starving = lora_starving or starves(request)
                held.append(self.waiting.pop())  # waits for a slot; others go by
                continue
            if self._cannot_ever_fit(request):
                self.waiting.pop()
                self._finish_unschedulable(request, request.num_tokens)
                continue
            hit_blocks, num_hit = kv.get_computed_blocks(request)
            if not self.chunked_prefill and request.num_tokens - num_hit > budget:
                break  # whole or not at all: it goes first once running ones leave room
            num_new = min(request.num_tokens - num_hit, budget)
            if kv.allocate_slots(request, num_new, hit_blocks,
                                 self._lookahead(request, num_hit, num_new)) is None:
                break  # nobody overtakes the head, which preempts no one (vLLM V1): it waits
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            if request.first_scheduled_time is None:  # once: a preempted one keeps its first
                request.first_scheduled_time = time.monotonic()
            bisect.insort(self.running, request, key=self._key)
            new_reqs.append(NewRequestData(
                req_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids),
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params,
                block_ids=kv.get_block_ids(request.request_id), num_computed_tokens=num_hit,
                group_block_ids=kv.other_group_block_ids(request.request_id),
                lora_request=request.lora_request))
            num_scheduled[request.request_id] = num_new
            budget -= num_new
        self.waiting.prepend_all(held)

        for req_id, num_new in num_scheduled.items():
            self.requests[req_id].num_computed_tokens += num_new
        total = sum(num_scheduled.values())
        # Bitmask rows for the structured requests whose step ends on their last token (they
        # sample); a partial prefill chunk samples nothing.
        sampling = [r for r in map(self.requests.get, num_scheduled)
                    if r.structured_output_request is not None
                    and r.num_computed_tokens >= r.num_tokens]
        try:
            so_ids, bitmask = self.structured_output_manager.grammar_bitmask(sampling)
        except BaseException:  # the step is committed above but will never run: take it back
            self._undo(num_scheduled)
            raise
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled, total_num_scheduled_tokens=total,
            finished_req_ids=set(self.finished_req_ids),
            preempted_req_ids=set(self.preempted_req_ids),
            structured_output_request_ids=so_ids, grammar_bitmask=bitmask,
            scheduled_spec_decode_tokens=spec_tokens)
        # The forget-lists are dropped in update_from_output, once the runner has taken the step:
        # an empty step or a failed forward must hand them on to the next step.
        return output

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop checks, free finished requests, report progress."""
        outputs, self._finished_outputs = self._finished_outputs, []
        if scheduler_output.total_num_scheduled_tokens > 0:
            # The runner has forgotten these; ids finished from here on go to the next step.
            self.finished_req_ids -= scheduler_output.finished_req_ids
            self.preempted_req_ids -= scheduler_output.preempted_req_ids
        row = {req_id: i for i, req_id in enumerate(model_runner_output.req_ids)}
        finished: list[Request] = []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue  # ended between schedule and update
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts and row.get(req_id) is not None:
                self.spec_decode.settle(request, drafts,
                                        model_runner_output.sampled_token_ids[row[req_id]])
            if self.spec_decode is not None and self.spec_decode.from_runner:
                # a draft model's proposals for the next step
                request.spec_token_ids = model_runner_output.spec_token_ids.get(req_id, [])
            output = step_output(request, model_runner_output, row.get(req_id),
                                 self.max_model_len)
            if output is None:
                continue  # a partial prefill chunk: nothing to report yet
            outputs.append(output)
            if request.is_finished():
                finished.append(request)
        if finished:
            gone = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in gone]
            for request in finished:
                self._release(request)
        return outputs

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            kv_cache_usage=kv.usage(), num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_blocks, prefix_cache_queries=kv.prefix_cache_stats.queries,
            prefix_cache_hits=kv.prefix_cache_stats.hits, num_preemptions=self.num_preemptions,
            **spec_decode_stats(self.spec_decode),
            **({} if self.max_loras is None else lora_stats(self.running, self.waiting)))

    # ---- helpers ------------------------------------------------------------------------------
    def _key(self, request: Request) -> tuple:
        return self._order[request.request_id]

    def _lookahead(self, request: Request, num_computed: int, num_new: int) -> int:
        """Slots a draft model writes past the step's tokens (0 without one, or for a request
        it will not draft for), within the context and the whole cache."""
        if self.spec_decode is None:
            return 0
        kv = self.kv_cache_manager
        # under a window a request's blocks stay bounded however far it runs
        limit = (self.max_model_len if kv.bounded
                 else min(self.max_model_len, kv.num_blocks * kv.block_size))
        return self.spec_decode.lookahead(request, num_computed, num_new, self.max_model_len,
                                          limit)

    def _cannot_ever_fit(self, request: Request) -> bool:
        kv = self.kv_cache_manager
        return (request.num_tokens > self.max_model_len
                or group_peak_blocks(kv.group_windows, request.num_tokens,
                                     self.max_num_batched_tokens, self.max_lookahead,
                                     kv.block_size) > kv.num_blocks)
