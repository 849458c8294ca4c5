"""`EngineCore`: owns the executor and the scheduler and runs schedule -> execute -> update.

Built once per engine: it sizes the KV cache through the executor, warms the model up, then
serves steps. The engine front talks to it through add/abort/step only.
"""
import time
from collections.abc import Iterable, Sequence

from kiln.core.core_sleep import CoreSleepMode
from kiln.core.kv_cache_groups import group_peak_blocks, kv_cache_groups_of, max_fitting_tokens
from kiln.core.outputs import EMPTY_MODEL_RUNNER_OUTPUT, EngineCoreOutput
from kiln.core.parent_request import child_requests
from kiln.core.request import Request, RequestStatus
from kiln.core.scheduler import Scheduler
from kiln.core.stats import SchedulerStats
from kiln.errors import ConfigError
from kiln.logger import init_logger
from kiln.lora.load_failure import LoRALoadError, end_adapter_requests
from kiln.spec_decode.scheduling import max_lookahead

logger = init_logger(__name__)


_GIB = 1 << 30


def kv_cache_too_small_message(max_model_len: int, block_size: int, num_blocks: int,
                               block_bytes: int | None, override: int | None = None,
                               capacity: int | None = None,
                               needed_blocks: int | None = None) -> str:
    """vLLM's refusal when one max_model_len request does not fit the KV cache; with
    --num-gpu-blocks-override set (`override`) only it resizes the cache, so it is named.
    `capacity`: the longest request that fits (default: a block per block_size tokens);
    `needed_blocks`: the blocks a max_model_len request holds at once (default: a block per
    block_size tokens; KV cache groups need each group's, kv_cache_groups.group_peak_blocks)."""
    if capacity is None:
        capacity = num_blocks * block_size
    if needed_blocks is None:
        needed_blocks = -(-max_model_len // block_size)
    if block_bytes is None:  # an executor that does not say: in tokens
        need, have = f"{max_model_len} tokens of", f"{capacity} tokens"
    else:
        need, have = _amount(needed_blocks * block_bytes), _amount(num_blocks * block_bytes)
    grow = ("`gpu_memory_utilization` (`--kv-cache-memory` on CPU)" if override is None else
            f"`--num-gpu-blocks-override` (set to {override})")
    return (f"To serve at least one request with the model's max seq len ({max_model_len}), "
            f"({need} KV cache is needed, which is larger than the available KV cache memory "
            f"({have}). Based on the available memory, the estimated maximum model length is "
            f"{capacity}. Try increasing {grow} or decreasing `max_model_len` when "
            "initializing the engine.")


def _amount(num_bytes: int) -> str:
    # vLLM says GiB; a tiny model's cache read "0.00 GiB is needed ... larger than 0.00 GiB".
    for unit, size in (("GiB", _GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes} bytes"


class EngineCore(CoreSleepMode):
    def __init__(self, kiln_config, executor_class: type):
        self.kiln_config = kiln_config
        # What a request may reach: the config's, or lower where the KV cache holds less.
        self.max_model_len: int = kiln_config.model_config.max_model_len
        # Seconds per start-up phase (kiln bench startup prints them).
        self.startup_timings: dict[str, float] = {}
        start = time.perf_counter()
        self.executor = executor_class(kiln_config)
        self.startup_timings["load_model_s"] = time.perf_counter() - start
        try:
            start = time.perf_counter()
            self.num_blocks = self._initialize_kv_cache()  # the KV cache's size, in blocks
            self.startup_timings["kv_cache_s"] = time.perf_counter() - start
            start = time.perf_counter()
            self.executor.compile_or_warm_up_model()
            self.startup_timings["compile_warm_up_s"] = time.perf_counter() - start
            logger.info("model compiled / warmed up in %.2f s",
                        self.startup_timings["compile_warm_up_s"])
        except BaseException:
            self.executor.shutdown()
            raise
        self.scheduler = Scheduler(kiln_config, self.num_blocks, self.max_model_len)
        logger.info("engine core ready: %d KV blocks of %d tokens", self.num_blocks,
                    kiln_config.cache_config.block_size)

    def _initialize_kv_cache(self) -> int:
        cache = self.kiln_config.cache_config
        # Profile even with an override: the worker may rely on the profiling run having happened.
        num_blocks = self.executor.determine_num_blocks()
        if cache.num_gpu_blocks_override is not None:
            logger.info("num_gpu_blocks_override=%d replaces the measured %d KV blocks",
                        cache.num_gpu_blocks_override, num_blocks)
            num_blocks = cache.num_gpu_blocks_override
        if num_blocks < 1:
            raise ConfigError(f"no memory left for the KV cache (num_blocks={num_blocks}); raise "
                              "--kv-cache-memory / --gpu-memory-utilization or use a smaller model")
        self.max_model_len = self._fit_max_model_len(num_blocks)
        self.executor.initialize_cache(num_blocks, self.max_model_len)
        return num_blocks

    def _fit_max_model_len(self, num_blocks: int) -> int:
        """One request of max_model_len must fit the KV cache, or it would be cut short with
        finish_reason "length": refuse to start (vLLM's check, which counts an overridden block
        count too), or, when max_model_len is the model's own and not the user's, lower it to
        what fits (returned; the config keeps the one it resolved)."""
        model, cache = self.kiln_config.model_config, self.kiln_config.cache_config
        max_model_len = model.max_model_len
        # A windowed group holds a bounded number of blocks however long a request runs, so the
        # KV cache may serve more tokens than it has slots (vLLM sizes sliding layers' need
        # alike); a full-attention group needs a block per block_size tokens.
        windows = kv_cache_groups_of(self.kiln_config).windows
        chunk = self.kiln_config.scheduler_config.max_num_batched_tokens
        lookahead = max_lookahead(self.kiln_config.speculative_config)
        capacity = max_fitting_tokens(windows, num_blocks, chunk, lookahead, cache.block_size,
                                      max_model_len)
        if capacity >= max_model_len:
            return max_model_len
        if model.max_model_len_from_model and capacity > 0:
            logger.warning("the KV cache holds %d tokens, fewer than the model's max_model_len "
                           "%d: max_model_len is capped at %d. Raise %s for longer requests",
                           capacity, max_model_len, capacity, cache.larger_cache_flags())
            return capacity
        # --num-gpu-blocks-override 2 --max-model-len 512 started with a 32-token cache and cut
        # every longer request short; vLLM refuses it (its check runs on the overridden count).
        block_bytes = getattr(self.executor, "kv_cache_block_bytes", None)
        raise ConfigError(kv_cache_too_small_message(
            max_model_len, cache.block_size, num_blocks,
            block_bytes() if block_bytes is not None else None, cache.num_gpu_blocks_override,
            capacity, group_peak_blocks(windows, max_model_len, chunk, lookahead,
                                        cache.block_size)))

    def add_request(self, request: Request, child_ids: Sequence[str] = ()) -> None:
        """`child_ids`: `request` is an n > 1 request, and its samples are added as child
        requests of these ids sharing its params' fields (parent_request.py); all or none."""
        if not child_ids:
            self.scheduler.add_request(request)
            return
        added = []
        try:
            for child in child_requests(request, child_ids):
                self.scheduler.add_request(child)
                added.append(child.request_id)
        except BaseException:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise

    def abort_requests(self, req_ids: str | Iterable[str]) -> None:
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        """Forget every cached block hash; False (nothing done) while requests hold blocks,
        unless `reset_running_requests` sends them back to the queue first (vLLM's arguments;
        Kiln has no KV connector, so `reset_connector` has nothing to reset)."""
        return self.scheduler.reset_prefix_cache(reset_running_requests)

    def finish_requests(self, req_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """End requests with a given status (the output processor uses it for stop strings)."""
        self.scheduler.finish_requests(req_ids, finished_status)

    def step(self) -> list[EngineCoreOutput]:
        """One step's outputs (with those of requests a sleep ended); nothing runs while the
        engine sleeps (core_sleep.py): its requests wait."""
        outputs = self.take_sleep_outputs()
        if self.paused or not self.scheduler.has_unfinished_requests():
            if self.paused and not outputs:  # in-process, a caller polls: not a busy spin
                time.sleep(0.01)
            return outputs
        return outputs + self._step() if outputs else self._step()

    def _step(self) -> list[EngineCoreOutput]:
        kv = self.scheduler.kv_cache_manager
        scheduler_output = None
        try:
            scheduler_output = self.scheduler.schedule()
            model_runner_output = EMPTY_MODEL_RUNNER_OUTPUT
            # With nothing to run, requests the scheduler ended on its own still need reporting.
            if scheduler_output.total_num_scheduled_tokens:
                model_runner_output = self.executor.execute_model(scheduler_output)
            else:  # only grammars still compiling, perhaps: wait a little rather than spin
                self.scheduler.wait_for_grammars(timeout=0.01)
        except BaseException as error:
            # Ctrl-C in LLM.generate, a failed forward: the prefix cache must not keep blocks
            # this step registered but never wrote, or a later prompt reads garbage K/V; and
            # the step's requests computed nothing, so they are computed again.
            kv.forget_unwritten()
            if scheduler_output is not None:
                self.scheduler.undo_step(scheduler_output)
            if isinstance(error, LoRALoadError):  # that adapter's requests end, not the core
                return end_adapter_requests(self.scheduler, error)
            raise
        kv.mark_written()
        return self.scheduler.update_from_output(scheduler_output, model_runner_output)

    def has_unfinished_requests(self) -> bool:
        # requests a sleep(mode="abort") ended count until step() reports them: an in-process
        # client steps only while this is true
        return bool(self._sleep_outputs) or self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def shutdown(self) -> None:
        if hasattr(self, "scheduler"):
            self.scheduler.structured_output_manager.shutdown()
        self.executor.shutdown()
