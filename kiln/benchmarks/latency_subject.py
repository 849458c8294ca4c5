"""One compilation config under the latency benchmark: its plan checked against the config's
limits, its engine built (`start_subject`), its figures recorded and reported (`Subject`).
"""
import dataclasses
import math
import time

from kiln.benchmarks.decode_steps import summarize_ms
from kiln.benchmarks.engine_probe import engine_runner, model_weight_bytes
from kiln.benchmarks.throughput import random_prompts
from kiln.engine.arg_utils import EngineArgs
from kiln.logger import init_logger

logger = init_logger(__name__)


def check_plan(batch_sizes: list[int], input_len: int, num_steps: int, warmup_steps: int,
               max_num_seqs: int, max_model_len: int) -> None:
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"--batch-sizes must be positive integers, got {batch_sizes}")
    if input_len < 1 or num_steps < 1 or warmup_steps < 0:
        raise ValueError(f"--input-len and --num-steps must be >= 1 and --warmup-steps >= 0, got "
                         f"{input_len}, {num_steps}, {warmup_steps}")
    if max(batch_sizes) > max_num_seqs:
        raise ValueError(f"batch size {max(batch_sizes)} exceeds max_num_seqs ({max_num_seqs}): "
                         "raise --max-num-seqs so the whole batch decodes in one step")
    if input_len + warmup_steps + num_steps + 2 > max_model_len:
        raise ValueError(f"--input-len {input_len} + --warmup-steps {warmup_steps} + --num-steps "
                         f"{num_steps} (+2) exceeds max_model_len {max_model_len}; shorten them "
                         "or raise --max-model-len")


def check_kv_capacity(batch_size: int, tokens_per_request: int, num_blocks: int,
                      block_size: int) -> None:
    need = batch_size * math.ceil(tokens_per_request / block_size)
    if need > num_blocks:
        raise ValueError(f"batch {batch_size} x {tokens_per_request} tokens needs {need} KV blocks, "
                         f"the cache has {num_blocks}: requests would be preempted mid-measurement. "
                         "Raise --kv-cache-memory (CPU) / --gpu-memory-utilization, or lower "
                         "--batch-sizes / --num-steps")


@dataclasses.dataclass
class Subject:
    """One compilation config's engine under test, with what the report says about it."""
    label: str
    spec: dict
    engine_args: EngineArgs
    engine: object
    kiln_config: object
    startup_s: float
    weight_bytes: int | None
    cudagraph_mode: str  # as the model runner resolved it (the request may be downgraded)
    results: dict = dataclasses.field(default_factory=dict)

    def prompts(self, batch_size: int, input_len: int) -> list[list[int]]:
        mc = self.kiln_config.model_config
        exclude = set(getattr(self.engine.tokenizer, "all_special_ids", []))
        return random_prompts(batch_size, input_len, mc.vocab_size,
                              self.engine_args.seed + batch_size, exclude)

    def max_tokens(self, input_len: int) -> int:
        """Generation budget of a prompt of input_len (the bench aborts long before it)."""
        return self.kiln_config.model_config.max_model_len - input_len

    def record(self, batch_size: int, times: list[float]) -> None:
        self.results[str(batch_size)] = summarize_ms(times)
        logger.info("bench latency: %s batch %d: median %.3f ms/step", self.label, batch_size,
                    self.results[str(batch_size)]["median_ms"])

    def report(self) -> dict:
        cc, mc = self.kiln_config.compilation_config, self.kiln_config.model_config
        return {"spec": self.label, "compilation_config": self.spec,
                "compilation_mode": int(cc.mode), "cudagraph_mode": self.cudagraph_mode,
                "startup_s": self.startup_s,
                "model_weight_bytes": self.weight_bytes, "model": mc.model,
                "dtype": str(mc.torch_dtype).removeprefix("torch."),
                "device": self.kiln_config.device_config.device, "results": self.results}


def start_subject(label: str, spec: dict, engine_args: EngineArgs, batch_sizes: list[int],
                  input_len: int, num_steps: int, warmup_steps: int) -> Subject:
    """Check the plan against this config's limits, then build its engine."""
    from kiln.engine.llm_engine import LLMEngine

    args = dataclasses.replace(engine_args, compilation_config=spec)
    kiln_config = args.create_kiln_config()
    mc, sched, cache = (kiln_config.model_config, kiln_config.scheduler_config,
                        kiln_config.cache_config)
    check_plan(batch_sizes, input_len, num_steps, warmup_steps, sched.max_num_seqs,
               mc.max_model_len)
    start = time.perf_counter()
    # In this process: a core process runs ahead of step(), and the model is read here.
    engine = LLMEngine(kiln_config, multiprocess=False)
    startup_s = time.perf_counter() - start
    runner = engine_runner(engine)
    # -tp / -pp: the ranks resolve the mode; the report gives the one asked for
    cudagraph_mode = (runner.cudagraph_dispatcher.cudagraph_mode.name if runner is not None
                      else f"{kiln_config.compilation_config.cudagraph_mode} (requested)")
    subject = Subject(label, spec, args, engine, kiln_config, startup_s,
                      model_weight_bytes(engine), cudagraph_mode)
    try:
        for b in batch_sizes:
            check_kv_capacity(b, input_len + warmup_steps + num_steps + 2,
                              engine.engine_core.num_blocks,
                              cache.block_size)
    except ValueError:
        engine.shutdown()
        raise
    return subject
