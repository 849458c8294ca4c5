"""`LLMEngine`: the synchronous engine front: tokenize and validate, feed the core, detokenize.

One `step()` runs one core step (schedule -> execute -> update) and returns the RequestOutputs
it produced; the LLM class and the CLI drive it in a loop.
"""
import math
import os
import time
import weakref

from kiln import envs
from kiln.config import KilnConfig, ParallelConfig
from kiln.config.settled_length import with_settled_max_model_len
from kiln.core.parent_request import child_params, child_request_id
from kiln.core.request import Request, RequestStatus
from kiln.core.request_queue import check_priority
from kiln.core.sliding_window_blocks import prompt_tokens_cached
from kiln.engine.arg_utils import EngineArgs
from kiln.engine.engine_chat import EngineChat
from kiln.engine.engine_sleep import EngineSleepMode
from kiln.engine.engine_token_stats import EngineTokenStats, StepTokens
from kiln.engine.engine_vllm_views import EngineVllmViews
from kiln.engine.input_processor import InputProcessor, ProcessedPrompt, PromptType
from kiln.engine.output_processor import OutputProcessor
from kiln.engine.text_encoding import check_request_id
from kiln.engine.tokenizer import config_eos_token_ids, generation_eos_token_ids, get_tokenizer
from kiln.logger import init_logger
from kiln.lora.frontend import LoRAChecker, with_lora
from kiln.outputs import RequestOutput
from kiln.sampling_params import SamplingParams

logger = init_logger(__name__)


def get_executor_class(parallel_config: ParallelConfig) -> type:
    """The executor for a parallel config: in-process for one rank, else processes or Ray."""
    backend = parallel_config.distributed_executor_backend
    if backend == "uni":
        from kiln.executor.uniproc_executor import UniprocExecutor
        return UniprocExecutor
    if backend == "ray":
        from kiln.executor.ray_executor import RayExecutor
        return RayExecutor
    from kiln.executor.multiproc_executor import MultiprocExecutor
    return MultiprocExecutor


class LLMEngine(EngineChat, EngineTokenStats, EngineVllmViews, EngineSleepMode):
    def __init__(self, kiln_config: KilnConfig, executor_class: type | None = None,
                 core_interpreter=None, multiprocess: bool | None = None,
                 front_end_cores: int = 0):
        """`core_interpreter`: a core_interpreter.CoreInterpreter started before the config was
        built (from_engine_args does). `multiprocess`: the core in its own process (None:
        KILN_ENABLE_V1_MULTIPROCESSING, default on); False for one core step per step().
        `front_end_cores`: cores a core process running the model on CPU leaves to this one
        once warm (in-process, none: this process's threads are the caller's)."""
        if multiprocess is None:
            multiprocess = envs.enable_multiprocessing()
        from kiln.engine.dp_core_client import start_core_process
        from kiln.engine.inproc_core_client import InprocCoreClient

        self.kiln_config = kiln_config
        self.model_config = kiln_config.model_config
        if executor_class is None:
            try:
                executor_class = get_executor_class(kiln_config.parallel_config)
            except BaseException:
                if core_interpreter is not None:
                    core_interpreter.discard()
                raise
        # The core process starts first and loads the model while this process loads the
        # tokenizer; in-process, the tokenizer first: a bad path fails before the model loads.
        self.engine_core = None
        # Seconds per start-up phase of this process (the core's are in engine_core's).
        self.startup_timings: dict[str, float] = {}
        clock = time.perf_counter()
        starting = start_core_process(kiln_config, executor_class, core_interpreter,
                                      front_end_cores, multiprocess)
        try:
            self.tokenizer = get_tokenizer(self.model_config)  # None: skip_tokenizer_init
            eos_ids = generation_eos_token_ids(self.model_config)
            if self.tokenizer is None:  # no tokenizer to name eos: the model config does
                eos_ids |= config_eos_token_ids(self.model_config)
            self.input_processor = InputProcessor(self.model_config, self.tokenizer, eos_ids)
            self.input_processor.lora_checker = LoRAChecker(kiln_config)
            self.output_processor = OutputProcessor(self.tokenizer)
            self.startup_timings["tokenizer_s"] = time.perf_counter() - clock
            clock = time.perf_counter()
            if starting is not None:
                starting.wait_until_ready()
                self.engine_core = starting
            else:
                self.engine_core = InprocCoreClient(kiln_config, executor_class)
            # In a core process: what was left after the tokenizer, overlapping it.
            self.startup_timings["core_ready_wait_s"] = time.perf_counter() - clock
        except BaseException:
            if starting is not None:
                starting.shutdown()
            raise
        self.input_processor.kv_cache_tokens = prompt_tokens_cached(kiln_config,
                                                                    self.engine_core.num_blocks)
        self.input_processor.larger_cache_flags = kiln_config.cache_config.larger_cache_flags()
        # The core may have lowered it to what the KV cache holds: so do the configs read.
        self.input_processor.max_model_len = self.engine_core.max_model_len
        self.kiln_config = with_settled_max_model_len(kiln_config, self.engine_core.max_model_len)
        self.model_config = self.kiln_config.model_config
        # Dropped without shutdown(), the engine still shuts its core down: a worker keeps
        # the start-up heap out of the garbage collector's reach until then (host_memory.py).
        self._shutdown = weakref.finalize(self, self.engine_core.shutdown)
        self._shutdown.atexit = False
        # Totals since start, counted as the server's metrics count them (request_stats.py):
        # a prompt once per sample, when that sample's first token shows its prefill is done.
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        # Each core step the last step() took in that had outputs the user saw: its replica
        # and tokens (vLLM's iteration_tokens_total observes one value per such step).
        self.last_steps: list[StepTokens] = []
        # do_log_stats()'s window: since when, and the totals then (engine_vllm_views.py)
        self._last_logged = (time.monotonic(), 0, 0, 0, 0, None)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, served: bool = False,
                         kiln_config: KilnConfig | None = None) -> "LLMEngine":
        """`served`: the front end is a server (AsyncLLM), whose event loop and tokenizing
        need a core of their own: the core leaves it one unless KILN_CPU_NUM_OF_RESERVED_CPU
        says otherwise. `LLM`'s front end only waits for outputs: it leaves none.
        `kiln_config`: `engine_args.create_kiln_config()` where the caller made it already
        (`kiln chat` checks the chat template before the model loads), not made again."""
        from kiln import vllm_envs
        from kiln.engine import core_interpreter

        vllm_envs.warn_unhonoured_once(os.environ)
        front_end_cores = envs.cpu_num_reserved_cpu(default=1 if served else 0)
        interpreter = core_interpreter.take() if envs.enable_multiprocessing() else None
        timings = {}
        if kiln_config is None:
            try:
                start = time.perf_counter()
                kiln_config = engine_args.create_kiln_config()
                timings["config_s"] = time.perf_counter() - start
            except BaseException:
                if interpreter is not None:
                    interpreter.discard()
                raise
        engine = cls(kiln_config, core_interpreter=interpreter, front_end_cores=front_end_cores)
        engine.startup_timings = {**timings, **engine.startup_timings}
        return engine

    @property
    def num_blocks(self) -> int:
        """The KV cache's size in blocks, as the core sized it (not a config field)."""
        return self._core().num_blocks

    @property
    def num_threads(self) -> int | None:
        """torch's threads in the core for steps (fewer than the cores where some are left to
        the front end); None for a core that does not say."""
        return getattr(self._core(), "num_threads", None)

    @property
    def max_model_len(self) -> int:
        """What a request may reach: the config's, or lower where the core capped it to what
        the KV cache holds."""
        return self._core().max_model_len

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation-config defaults (--generation-config)."""
        return SamplingParams(**self.model_config.generation_defaults)

    # ---- requests in -------------------------------------------------------------------------

    def process_inputs(self, prompt: PromptType, params: SamplingParams | None, *,
                       max_tokens_must_fit: bool = False) -> ProcessedPrompt:
        """Tokenize and validate without touching engine state (raises ValueError)."""
        return self.input_processor.process(prompt, params,
                                            max_tokens_must_fit=max_tokens_must_fit)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, lora_request=None, *,
                    max_tokens_must_fit: bool = False, priority: int = 0) -> None:
        """`arrival_time`: time.monotonic() when it arrived (vLLM's is time.time(): queue
        order and latency metrics read this clock). `priority`: vLLM's; lower is served first
        under --scheduling-policy priority, ignored under fcfs. `lora_request`: vLLM's
        LoRARequest (kiln/lora/), as its multilora example passes it."""
        prompt = with_lora(prompt, lora_request)
        processed = self.process_inputs(prompt, params, max_tokens_must_fit=max_tokens_must_fit)
        self.add_processed_request(request_id, processed, arrival_time, priority=priority)

    def add_processed_request(self, request_id: str, processed: ProcessedPrompt,
                              arrival_time: float | None = None, *, priority: int = 0) -> int:
        """Returns the data-parallel replica it went to (0 without data parallel)."""
        check_priority(priority)
        check_request_id(request_id)
        core = self._core()
        params = processed.params
        if params.n == 1:
            samples = [(request_id, params)]
        else:
            samples = [(child_request_id(i, request_id), child_params(params, i))
                       for i in range(params.n)]
        in_use = [cid for cid, _ in samples if cid in self.output_processor.samples]
        if request_id in self.output_processor.requests or in_use:
            raise ValueError(f"request id {request_id!r} is already in use by an unfinished "
                             "request; pick a unique request_id")
        now = time.monotonic()
        if arrival_time is not None and not math.isfinite(arrival_time):
            # NaN sorts nowhere: the scheduler's queues (keyed by arrival) lost their order and
            # a full cache preempted a request already scheduled in the step: the core died.
            raise ValueError(f"arrival_time must be a finite time.monotonic() value, got "
                             f"{arrival_time}")
        if arrival_time is not None and arrival_time > now + 1:
            raise ValueError(f"arrival_time {arrival_time} is in the future of time.monotonic() "
                             f"({now:.0f}); Kiln's arrival times are time.monotonic() values "
                             "(vLLM's time.time() would reorder the queue)")
        arrival = now if arrival_time is None else arrival_time
        # One core request: an n > 1 request goes once with its samples' ids, and the core makes
        # them (parent_request.py), so its params cross to the core process once, not n times.
        core_request = Request(request_id=request_id,
                               prompt_token_ids=list(processed.prompt_token_ids),
                               sampling_params=params, arrival_time=arrival,
                               cache_salt=processed.cache_salt, priority=priority,
                               lora_request=processed.lora_request)
        child_ids = [cid for cid, _ in samples] if params.n > 1 else []
        self.output_processor.add_request(request_id, processed.prompt, processed.prompt_token_ids,
                                          samples, params.output_kind)
        # vLLM's RequestOutput.lora_request, on every output of engine.step() too
        self.output_processor.requests[request_id].lora_request = processed.lora_request
        try:
            replica = core.add_request(core_request, child_ids)
        except BaseException:
            # Leave no half-added request behind (the core adds a parent's samples all or
            # none): other requests must be unaffected.
            self.output_processor.abort_requests([request_id])
            raise
        return replica if isinstance(replica, int) else 0  # only DPCoreClient's picks one

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        """vLLM's: False while running requests hold blocks, unless `reset_running_requests`
        sends them back to the queue (to be recomputed) first."""
        return self._core().reset_prefix_cache(bool(reset_running_requests),
                                               bool(reset_connector))

    def abort_request(self, request_ids: list[str] | str) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        core_ids = self.output_processor.abort_requests(list(request_ids))
        if core_ids and self.engine_core is not None:  # a shut-down core has none to abort
            self.engine_core.abort_requests(core_ids)

    # ---- stepping ----------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        core = self._core()
        self.last_steps = []
        if not core.has_unfinished_requests():
            return []
        steps = core.step()
        core_outputs = [out for outputs in steps for out in outputs]
        processed = self.output_processor.process_outputs(core_outputs)
        # Only a data-parallel client's steps come from several replicas (core index per step).
        engines = getattr(core, "last_step_engines", None) or [0] * len(steps)
        self.last_steps = self._count_tokens(steps, processed.seen_tokens, engines)
        if processed.reqs_to_finish:
            # Stop strings are found here, not in the core: release those requests' blocks now.
            core.finish_requests(processed.reqs_to_finish, RequestStatus.FINISHED_STOPPED)
        return processed.request_outputs

    def add_death_callback(self, callback) -> None:
        """`callback(error)` runs (on another thread) if the core process dies unasked."""
        self._core().add_death_callback(callback)

    def _core(self):
        if self.engine_core is None:
            raise RuntimeError("this engine was shut down (shutdown()); create a new LLM or "
                               "engine to generate again")
        return self.engine_core

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine core, once. `timeout` (vLLM's): the seconds its process gets to exit
        in order before it is stopped by force (None: the core client's default)."""
        self.engine_core = None
        finalizer = getattr(self, "_shutdown", None)
        pending = finalizer.detach() if finalizer is not None else None  # None: done already
        if pending is not None:
            _, core_shutdown, args, kwargs = pending
            core_shutdown(*args, **kwargs, timeout=timeout)
