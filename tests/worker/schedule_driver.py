"""A test double for the scheduler: builds SchedulerOutputs from hand-written per-step plans.

It allocates fresh KV blocks as requests grow, and can preempt (with or without keeping the
prefix blocks, as a prefix-cache hit would) and finish requests.
"""
from dataclasses import dataclass, field

from kiln.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from kiln.sampling_params import SamplingParams


@dataclass
class DriverRequest:
    prompt: list[int]
    params: SamplingParams
    outputs: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    sent: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.outputs)


class ScheduleDriver:
    def __init__(self, executor, block_size: int):
        self.executor, self.bs = executor, block_size
        self.reqs: dict[str, DriverRequest] = {}
        self.done: dict[str, DriverRequest] = {}  # finished requests, kept for their outputs
        self._next_block = 0
        self._finished: set[str] = set()
        self._preempted: set[str] = set()
        self.outputs = []  # every ModelRunnerOutput, in order

    def add(self, req_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.reqs[req_id] = DriverRequest(list(prompt), params)

    def preempt(self, req_id: str, keep_prefix: bool) -> None:
        r = self.reqs[req_id]
        self._finished.add(req_id)
        self._preempted.add(req_id)
        r.sent = False
        r.num_computed = (r.num_tokens - 1) // self.bs * self.bs if keep_prefix else 0
        r.blocks = r.blocks[:r.num_computed // self.bs]

    def finish(self, req_id: str) -> None:
        self._finished.add(req_id)
        self.done[req_id] = self.reqs.pop(req_id)

    def finish_all(self) -> None:
        """Finish every request and run an empty step so the runner forgets them."""
        for req_id in list(self.reqs):
            self.finish(req_id)
        self.step({})

    def tokens(self, req_id: str) -> list[int]:
        return (self.reqs.get(req_id) or self.done[req_id]).outputs

    def step(self, plan: dict[str, int]) -> dict[str, list[int]]:
        new, cached = [], CachedRequestData()
        for req_id, n in plan.items():
            r = self.reqs[req_id]
            need = -(-(r.num_computed + n) // self.bs) - len(r.blocks)
            fresh = list(range(self._next_block, self._next_block + max(need, 0)))
            self._next_block += len(fresh)
            r.blocks += fresh
            if not r.sent:
                new.append(NewRequestData(req_id, list(r.prompt), list(r.outputs), r.params,
                                          list(r.blocks), r.num_computed))
                r.sent = True
            else:
                cached.req_ids.append(req_id)
                cached.new_block_ids.append(fresh)
                cached.num_computed_tokens.append(r.num_computed)
        so = SchedulerOutput(new, cached, dict(plan), sum(plan.values()), self._finished,
                             self._preempted)
        self._finished, self._preempted = set(), set()
        out = self.executor.execute_model(so)
        self.outputs.append(out)
        assert out.req_ids == list(plan)
        result = {}
        for req_id, toks in zip(out.req_ids, out.sampled_token_ids):
            r = self.reqs[req_id]
            r.num_computed += plan[req_id]
            r.outputs += toks
            result[req_id] = toks
        return result
