"""Test doubles for the core: a config factory and an executor that fakes a model with a paged cache.

`PagedTokenExecutor` stores each token id in the KV slot its block table names, reads every
request's whole context back before "sampling", and derives the next token from what it read, so
a wrong block table, a bad prefix hit or a premature eviction changes the generated tokens. Under
a sliding window (make_config(window=...)) it reads and depends on each query's window only.
"""
from dataclasses import dataclass, field

from transformers import LlamaConfig, MistralConfig

from kiln.config import CacheConfig, KilnConfig, ModelConfig, SchedulerConfig
from kiln.core.outputs import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from kiln.core.request import Request
from kiln.sampling_params import SamplingParams

VOCAB = 1000


def make_config(*, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                max_model_len=None, enable_prefix_caching=True, override=None,
                policy="fcfs", window=None, chunked_prefill=True) -> KilnConfig:
    """`window`: a Mistral with that sliding window in every layer (else a Llama)."""
    if max_model_len is None:  # 256, or what an overridden cache holds: a larger one is refused
        max_model_len = 256 if override is None else min(256, override * block_size)
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                 max_position_embeddings=512)
    hf = (LlamaConfig(**sizes) if window is None else
          MistralConfig(sliding_window=window, architectures=["MistralForCausalLM"], **sizes))
    config = KilnConfig(
        model_config=ModelConfig(model="unused", hf_config=hf, load_format="dummy",
                                 max_model_len=max_model_len),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                                 num_gpu_blocks_override=override),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs,
                                         max_num_batched_tokens=max_num_batched_tokens,
                                         policy=policy,
                                         enable_chunked_prefill=chunked_prefill))
    return config


def make_request(req_id, prompt, max_tokens=8, arrival=None, priority=0, **params) -> Request:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, **params)
    if arrival is None:
        return Request(req_id, list(prompt), sp, priority=priority)
    return Request(req_id, list(prompt), sp, arrival_time=arrival, priority=priority)


def next_token(context: list[int]) -> int:
    """The fake model: a deterministic function of the whole context."""
    acc = 17
    for i, t in enumerate(context):
        acc = (acc * 31 + t * (i + 7)) % 1_000_003
    return 3 + acc % (VOCAB - 3)  # never 0..2, so tests pick stop tokens explicitly


def reference_tokens(prompt: list[int], n: int, window: int | None = None) -> list[int]:
    """The fake model's continuation; under a window each token depends on the last `window`."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq if window is None else seq[-window:]))
    return seq[len(prompt):]


@dataclass
class _RunnerRequest:
    tokens: list[int]
    block_ids: list[int]
    num_computed: int
    history: list[int] = field(default_factory=list)  # tokens scheduled per step


class PagedTokenExecutor:
    """Executor double honouring the real executor interface (docs/architecture.md, "Contracts")."""
    measured_blocks = 64

    def __init__(self, kiln_config):
        self.config = kiln_config
        self.block_size = kiln_config.cache_config.block_size
        self.window = kiln_config.model_config.get_sliding_window()
        self.reqs: dict[str, _RunnerRequest] = {}
        self.cache: list[list[int | None]] | None = None
        self.calls: list[str] = []
        self.outputs: list[SchedulerOutput] = []
        self.shut_down = False
        self.fail_next_step = False  # the next forward raises before it writes anything

    def determine_num_blocks(self) -> int:
        self.calls.append("determine_num_blocks")
        return self.measured_blocks

    def initialize_cache(self, num_blocks: int, max_model_len: int | None = None) -> None:
        self.calls.append("initialize_cache")
        self.cache = [[None] * self.block_size for _ in range(num_blocks)]

    def compile_or_warm_up_model(self) -> None:
        self.calls.append("compile_or_warm_up_model")

    def shutdown(self) -> None:
        self.shut_down = True

    def rank_sentinels(self) -> list:
        return []  # no rank processes: the model is this object

    def _slot(self, req: _RunnerRequest, pos: int) -> tuple[int, int]:
        return req.block_ids[pos // self.block_size], pos % self.block_size

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self.fail_next_step:
            self.fail_next_step = False
            raise KeyboardInterrupt("injected: Ctrl-C during the forward")
        sched = self.config.scheduler_config
        assert 0 < so.total_num_scheduled_tokens <= sched.max_num_batched_tokens
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert len(so.num_scheduled_tokens) <= sched.max_num_seqs
        self.outputs.append(so)
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.reqs.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.reqs, f"{new.req_id} sent as new twice"
            self.reqs[new.req_id] = _RunnerRequest(
                new.prompt_token_ids + new.output_token_ids, list(new.block_ids),
                new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for req_id, new_ids, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                 cached.num_computed_tokens):
            req = self.reqs[req_id]
            assert req.num_computed == num_computed, (req_id, req.num_computed, num_computed)
            req.block_ids.extend(new_ids)
        # Like the attention op: write the whole batch's K/V first, then read.
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.reqs[req_id]
            for pos in range(req.num_computed, req.num_computed + n):
                block, offset = self._slot(req, pos)
                self.cache[block][offset] = req.tokens[pos]
        req_ids, sampled, logprobs = [], [], {}
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.reqs[req_id]
            end = req.num_computed + n
            assert end <= len(req.tokens)
            # every key a query of the step sees: from the first one's window on
            first = 0 if self.window is None else max(0, req.num_computed + 1 - self.window)
            seen = [self.cache[b][o] for b, o in (self._slot(req, p) for p in range(first, end))]
            assert seen == req.tokens[first:end], (
                f"{req_id}: KV cache content does not match its tokens")
            if self.window is not None:
                seen = seen[-self.window:]
            req.num_computed = end
            req.history.append(n)
            req_ids.append(req_id)
            if end == len(req.tokens):
                token = next_token(seen)
                req.tokens.append(token)
                sampled.append([token])
                logprobs[req_id] = LogprobsLists([token], [-0.25], 1)
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids, sampled, logprobs)


def run_until_done(core, max_steps=2000) -> dict[str, list]:
    """Step an EngineCore to completion; returns req_id -> [tokens, finish_reason, stop_reason]."""
    results: dict[str, list] = {}
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            return results
        for out in core.step():
            entry = results.setdefault(out.request_id, [[], None, None])
            assert entry[1] is None, f"{out.request_id} reported after it finished"
            entry[0].extend(out.new_token_ids)
            entry[1], entry[2] = out.finish_reason, out.stop_reason
    raise AssertionError("engine did not finish within max_steps")
