"""`KilnConfig`: every sub-config in one object, cross-checked (cross_checks.py), plus the 'current' config.

Layers read the current config while the model is built (e.g. Attention registers itself).
"""
import contextlib
import functools
import hashlib
from dataclasses import dataclass, field

from kiln.config import cross_checks
from kiln.config.cache_config import CacheConfig
from kiln.config.compilation_config import CompilationConfig, CompilationMode
from kiln.config.device_config import DeviceConfig
from kiln.config.draft_model_config import resolve_draft_model_config
from kiln.config.frozen import FreezableConfig
from kiln.config.load_config import LoadConfig
from kiln.config.model_config import ModelConfig
from kiln.config.parallel_config import ParallelConfig
from kiln.config.quantization_rotation import resolve_quantization_rotation
from kiln.config.scheduler_config import SchedulerConfig
from kiln.config.speculative_config import SpeculativeConfig, check_speculative
from kiln.errors import ConfigError

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass
class KilnConfig(FreezableConfig):
    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    load_config: LoadConfig = field(default_factory=LoadConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    enforce_eager: bool = False
    # IR op -> providers in order of preference, over the platform's defaults (kiln/ir/)
    ir_op_priority: dict = field(default_factory=dict)
    # --speculative-config (n-gram prompt lookup or a draft model; kiln/spec_decode/), None: off
    speculative_config: SpeculativeConfig | None = None
    # LoRA serving (--enable-lora): a kiln.lora.config.LoRAConfig, None when off
    lora_config: object = None
    # the config a draft model or EAGLE head is built under (draft_kiln_config), which keys its
    # compile cache apart from the target's even when the draft is the target's own checkpoint
    is_draft: bool = False

    SUB_CONFIGS = ("model_config", "cache_config", "scheduler_config", "parallel_config",
                   "load_config", "device_config", "compilation_config")

    def __post_init__(self):
        subs = [getattr(self, name) for name in self.SUB_CONFIGS]
        for name, sub in zip(self.SUB_CONFIGS, subs):
            if getattr(sub, "frozen", False):  # resolved by another KilnConfig: resolve a copy
                setattr(self, name, sub.thawed_copy())
        self._resolve()
        for name in self.SUB_CONFIGS:
            getattr(self, name).freeze()
        self.freeze()

    def _resolve(self) -> None:
        from kiln.ir import check_priority
        from kiln.ir.selection import custom_ops_priority

        self.ir_op_priority = {
            **custom_ops_priority(self.compilation_config.custom_ops, self.device_config.device),
            **check_priority(self.ir_op_priority)}
        # "auto" dtype follows the configured device's platform, not the machine's: a CPU
        # engine on a GPU host keeps float32.
        self.model_config.torch_dtype = self.model_config.dtype = (
            self.model_config.resolve_dtype(self.platform.default_dtype))
        sched = self.scheduler_config
        sched.max_model_len = self.model_config.max_model_len
        if sched.max_num_batched_tokens is None:
            sched.max_num_batched_tokens = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, sched.max_num_seqs)
            if not sched.enable_chunked_prefill:  # vLLM's default without chunking
                sched.max_num_batched_tokens = max(sched.max_num_batched_tokens,
                                                   sched.max_model_len)
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < sched.max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens ({sched.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({sched.max_model_len}): without chunked prefill a longer prompt "
                "could never be scheduled; raise --max-num-batched-tokens, lower "
                "--max-model-len, or drop --no-enable-chunked-prefill")
        if sched.max_num_batched_tokens < sched.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({sched.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({sched.max_num_seqs}); raise --max-num-batched-tokens or lower --max-num-seqs")
        cross_checks.resolve_cache_dtype(self)
        cross_checks.check_memory(self)
        cross_checks.check_moe(self)
        resolve_quantization_rotation(self)
        cross_checks.check_kv_cache_dtype(self)
        check_speculative(self.speculative_config, self.parallel_config,
                          self.model_config.max_model_len)
        cross_checks.check_binding(self)
        if self.lora_config is not None:
            self.lora_config.check_parallel(self.parallel_config)
        # Read first inside Dynamo's backend, after the model loaded, where a bad value came out
        # as a BackendCompilerFailed traceback: checked here, in one line, as the others are.
        from kiln import envs

        envs.disable_compile_cache()
        if self.load_config.load_format == "auto":
            self.load_config.load_format = self.model_config.load_format
        else:
            self.model_config.load_format = self.load_config.load_format
        resolve_draft_model_config(self.speculative_config, self.model_config)
        self.compilation_config.resolve_mode(self.enforce_eager)
        compiles = self.compilation_config.mode == CompilationMode.KILN_COMPILE
        for size in self.compilation_config.compile_sizes:
            if compiles and size > sched.max_num_batched_tokens:
                raise ConfigError(f"compile size {size} exceeds max_num_batched_tokens "
                                  f"({sched.max_num_batched_tokens}): no step has that many "
                                  "tokens; drop it from compilation_config.compile_sizes or "
                                  "raise --max-num-batched-tokens")

    def for_rank(self, rank: int) -> "KilnConfig":
        """This config as rank `rank` sees it (each worker process gets its own); frozen too."""
        clone = self.thawed_copy()
        clone.parallel_config = self.parallel_config.for_rank(rank)
        clone.parallel_config.freeze()
        clone.freeze()
        return clone

    @property
    def platform(self):
        """The platform of the configured device (--device cpu on a GPU host: the CPU's)."""
        from kiln.platforms import for_device

        return for_device(self.device_config.device)

    @functools.cached_property
    def ir_selection(self):
        """Every IR op's chosen implementation for this engine, resolved once (kiln/ir/)."""
        from kiln.ir import resolve

        return resolve(self.ir_op_priority, self.device_config.device,
                       self.model_config.torch_dtype)

    def _int8_weight_layout(self) -> str:
        """How int8 weights are held here, which decides the GEMM op a graph calls: packed into
        panels at load on CPUs the int8 kernels run on, as stored elsewhere
        (w8a8_int8.pack_for_cpu)."""
        if self.model_config.quant_kind != "int8" or self.device_config.device != "cpu":
            return ""
        from kiln.native import int8_ops

        return "panels" if int8_ops.panel_cpu() else "rows"

    def compute_hash(self) -> str:
        """Hash of the factors that change the traced graph (part of the compile cache key)."""
        from kiln.config.eagle3_config import target_aux_layer_ids
        from kiln.config.inductor_options import inductor_options

        m, c = self.model_config, self.compilation_config
        factors = [
            m.architecture, repr(sorted((k, v) for k, v in m.hf_config.to_dict().items()
                                        if k != "_name_or_path"))  # the same model moved
            if hasattr(m.hf_config, "to_dict") else repr(m.hf_config),
            str(m.torch_dtype), m.quantization, m.quantization_rotation,
            self.device_config.device,
            self.cache_config.block_size,
            self.parallel_config.tensor_parallel_size,
            self.parallel_config.pipeline_parallel_size, self.scheduler_config.max_num_batched_tokens,
            int(c.mode), c.backend, c.splitting_ops, sorted(c.pass_config.items()),
            # with the options Kiln adds for the model (a cache from before they were added
            # compiled without them)
            sorted(inductor_options(self).items()), self.ir_selection.chosen,
            self._int8_weight_layout(),
            # LoRA layers add their op and buffers to the graph
            None if self.lora_config is None else repr(self.lora_config),
            # an EAGLE-3 head's auxiliary hidden states are graph outputs too
            target_aux_layer_ids(self), self.is_draft,
        ]
        return hashlib.sha256(repr(factors).encode()).hexdigest()[:16]


_current: KilnConfig | None = None


@contextlib.contextmanager
def set_current_kiln_config(config: KilnConfig):
    global _current
    previous, _current = _current, config
    try:
        yield
    finally:
        _current = previous


def get_current_kiln_config() -> KilnConfig:
    if _current is None:
        raise RuntimeError("no current KilnConfig: build models inside set_current_kiln_config()")
    return _current
