"""`Worker`: one device's share of the engine: device set-up, model, KV cache, warm-up, steps.

The executor drives it: init_device, load_model, determine_num_blocks, initialize_cache,
compile_or_warm_up_model, then execute_model once per engine step.
"""
import functools
import gc

import torch

from kiln import envs
from kiln.core.kv_cache_groups import group_peak_blocks, kv_cache_groups_of
from kiln.core.outputs import ModelRunnerOutput, SchedulerOutput
from kiln.cudagraphs.capture import capture_model
from kiln.logger import init_logger
from kiln.worker import kv_cache_layout, kv_cache_sizing
from kiln.worker.host_memory import freeze_gc_heap, zeros_on_first_touch
from kiln.worker.model_runner import ModelRunner
from kiln.worker.sleep_mode import WorkerSleepMode

logger = init_logger(__name__)


def warm_up_left_garbage(mode, before, after) -> bool:
    """Whether warm-up compiled or traced (compilation counters `before` and `after` it; stock
    torch.compile always may): that leaves cyclic garbage (graphs, fake tensors) worth a full
    collection before the heap is frozen. A warm start's loads left ~100 objects, not worth the
    collection's rescan of the whole heap (0.1-0.2 s on 2 cores)."""
    from kiln.config import CompilationMode

    return (mode == CompilationMode.STOCK_TORCH_COMPILE
            or after.num_dynamo_traces != before.num_dynamo_traces
            or after.num_inductor_compiles != before.num_inductor_compiles)


class Worker(WorkerSleepMode):
    def __init__(self, kiln_config, rank: int = 0, local_rank: int = 0,
                 local_world_size: int = 1):
        self.kiln_config = kiln_config
        self.rank, self.local_rank = rank, local_rank
        self.local_world_size = local_world_size  # ranks on this machine, this one included
        self.device: torch.device | None = None
        self.model_runner: ModelRunner | None = None
        self.num_blocks: int | None = None  # the KV cache's size once allocated
        self.kv_groups = kv_cache_groups_of(kiln_config)  # the scheduler's, layer by layer

    def init_device(self) -> None:
        device = self.kiln_config.device_config.device_obj
        if device.type == "cuda":
            device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(device)
        self.device = device
        self.platform = self.kiln_config.platform
        self.platform.seed_everything(self.kiln_config.model_config.seed)
        self.model_runner = ModelRunner(self.kiln_config, device)
        self.check_sleep_mode_fits()
        freeze_gc_heap()

    def load_model(self) -> None:
        self.model_runner.load_model()
        freeze_gc_heap()

    # ---- KV cache --------------------------------------------------------------------------
    def _attention_layers(self) -> list:
        """Every Attention layer that gets a KV cache: the model's, and a draft model's
        (speculative decoding; the same block tables, so the same block count)."""
        layers = self.model_runner.attention_layers
        if not layers:
            raise RuntimeError("the model has no Attention layers; was it loaded "
                               "(Worker.load_model)?")
        drafter = self.model_runner.drafter
        return [*layers.values(), *(drafter.attention_layers.values() if drafter else ())]

    def _layer_indices(self) -> list[int]:
        """_attention_layers' numbers among the KV cache groups' layers (the draft's after the
        target's)."""
        drafter = self.model_runner.drafter
        return kv_cache_layout.layer_indices(
            list(self.model_runner.attention_layers.values()),
            list(drafter.attention_layers.values()) if drafter else [],
            self.kiln_config.model_config.num_layers)

    def kv_cache_block_bytes(self) -> int:
        return kv_cache_layout.block_bytes(self._attention_layers(), self.kv_groups,
                                           self.kiln_config.cache_config.block_size,
                                           self._kv_cache_dtype(), self._layer_indices())

    def _kv_cache_dtype(self):
        return self.kiln_config.cache_config.torch_cache_dtype(
            self.kiln_config.model_config.torch_dtype)

    def determine_num_blocks(self) -> int:
        """KV blocks that fit this worker's budget (CUDA: measured after a profiling forward).
        The engine core applies num_gpu_blocks_override and warns when they hold less than
        max_model_len."""
        cache = self.kiln_config.cache_config
        block_bytes = self.kv_cache_block_bytes()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            self.model_runner.profile_run()
            torch.cuda.synchronize()
            free, total = self.platform.mem_get_info()
            budget = kv_cache_sizing.cuda_kv_cache_bytes(total, total - free,
                                                         cache.gpu_memory_utilization,
                                                         cache.kv_cache_memory)
            num_blocks = kv_cache_sizing.num_blocks_for(budget, block_bytes)
        else:
            budget = kv_cache_sizing.cpu_kv_cache_bytes(cache.kv_cache_memory,
                                                        envs.cpu_kvcache_space_gib())
            sched = self.kiln_config.scheduler_config
            max_len = self.kiln_config.model_config.max_model_len
            if self.kv_groups.hybrid:  # a request's need across the groups, in tokens
                max_len = cache.block_size * group_peak_blocks(
                    self.kv_groups.windows, max_len, sched.max_num_batched_tokens, 0,
                    cache.block_size)
            num_blocks = min(kv_cache_sizing.num_blocks_for(budget, block_bytes),
                             kv_cache_sizing.useful_block_cap(sched.max_num_seqs, max_len,
                                                              cache.block_size))
            warning = kv_cache_sizing.cpu_budget_warning(num_blocks * block_bytes,
                                                         self.platform.mem_get_info()[0],
                                                         self.local_world_size * self.kiln_config
                                                         .parallel_config.data_parallel_size)
            if warning:
                logger.warning("%s; lower --kv-cache-memory (or %s)", warning,
                               envs.source("KILN_CPU_KVCACHE_SPACE"))
        logger.info("KV cache budget %.3f GiB; room for %d blocks of %d tokens (%d bytes per "
                    "block)", budget / kv_cache_sizing.GiB, num_blocks, cache.block_size,
                    block_bytes)
        return num_blocks

    def initialize_cache(self, num_blocks: int, max_model_len: int | None = None) -> None:
        """Allocate the KV cache tensors (one per Attention layer, or per slot of the KV cache
        groups: kv_cache_layout.py) and hand them to the layers; `max_model_len`: the engine's,
        which the KV cache may have capped below the config's (longrope's factors follow it)."""
        cache = self.kiln_config.cache_config
        dtype = self._kv_cache_dtype()

        def new_tensor(layer):
            shape = layer.backend.get_kv_cache_shape(num_blocks, cache.block_size,
                                                     layer.num_kv_heads, layer.head_size)
            return (zeros_on_first_touch(shape, dtype) if self.device.type == "cpu"
                    else torch.zeros(shape, dtype=dtype, device=self.device))

        kv_cache_layout.assign_kv_caches(self._attention_layers(), self.kv_groups, new_tensor,
                                         self._layer_indices())
        self.num_blocks = num_blocks
        if max_model_len is not None:
            from kiln.model.layers.rotary_embedding import fit_rotary_to_max_model_len
            fit_rotary_to_max_model_len(self.model_runner.model, max_model_len)

    # ---- warm-up ---------------------------------------------------------------------------
    def compile_or_warm_up_model(self) -> None:
        from kiln.compilation.counters import compilation_counter
        from kiln.compilation.warmup import compile_and_warm_up

        before = compilation_counter.clone()
        # Every compiled shape (range + compile_sizes) is built here; afterwards a compile raises.
        # One token and a full decode batch run too, so their eager paths are warm as well.
        sched = self.kiln_config.scheduler_config
        compile_and_warm_up(self.model_runner.dummy_run, self.kiln_config,
                            self.model_runner.compile_state.warmup_phase,
                            extra_sizes=[1, min(sched.max_num_seqs, sched.max_num_batched_tokens)])
        drafter = self.model_runner.drafter
        if drafter is not None and drafter.compiles:  # a compiled draft: its own shapes
            from kiln.compilation import monitor

            with monitor.section("draft"):  # `kiln compile` reports it apart from the target
                compile_and_warm_up(functools.partial(drafter.dummy_run, self.model_runner),
                                    drafter.kiln_config, drafter.compile_state.warmup_phase,
                                    extra_sizes=[1])
        # Record every CUDA graph now, after compiling and before serving (no-op on CPU).
        capture_model(self.model_runner, self.model_runner.cudagraph_dispatcher, self.platform)
        self.platform.synchronize()
        # Warm-up must not change the sampling stream users see.
        self.platform.seed_everything(self.kiln_config.model_config.seed)
        freeze_gc_heap(collect=warm_up_left_garbage(self.kiln_config.compilation_config.mode,
                                                    before, compilation_counter))

    # ---- steps -----------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def collective_rpc(self, method, args=(), kwargs=None):
        """vLLM's: this worker's method `method` (a name), or `method(self, *args, **kwargs)`
        for a callable."""
        if isinstance(method, str):
            if method.startswith("_") or not callable(getattr(self, method, None)):
                raise ValueError(f"collective_rpc: the worker has no method {method!r}")
            return getattr(self, method)(*args, **(kwargs or {}))
        return method(self, *args, **(kwargs or {}))

    def shutdown(self) -> None:
        self.model_runner = None
        # What start-up froze is now garbage in cycles (a compiled model's pieces refer back to
        # it): collected now, not at some later collection, so that its weights, KV cache and
        # device memory are free for the next engine (bench --compare-unquantized builds one).
        gc.unfreeze()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
