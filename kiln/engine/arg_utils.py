"""`EngineArgs`: every engine knob with vLLM's names, and the KilnConfig it builds (its CLI flags
are engine_flags.py's; to_cli_args / from_cli_args cross between the two).

The LLM class, the CLI and the server all build their configuration through this one dataclass.
"""
import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, fields
from typing import Any

from kiln.config import (
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    KilnConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from kiln.config.compilation_config import CompilationMode, spec_to_dict
from kiln.config.speculative_config import SpeculativeConfig
from kiln.engine.engine_args_checks import DEFAULT_MAX_NUM_SEQS, EngineArgsChecks, dtype_name
from kiln.engine.engine_flags import add_engine_flags
from kiln.errors import ConfigError
from kiln.pooling.pooler_config import (
    auto_runner,
    pooler_config_json,
    resolve_pooler_config,
    resolve_runner,
)
from kiln.pooling.pooling_task import check_convert, pooling_task


@dataclass
class EngineArgs(EngineArgsChecks):
    model: str | None = None  # None: the embedded default model
    tokenizer: str | None = None  # None: the model's own tokenizer
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int | None = None
    scheduling_policy: str = "fcfs"  # vLLM's: "fcfs" or "priority" (requests' priority)
    enforce_eager: bool = False
    compilation_config: Any = None  # int | dict | str (mode or JSON) | CompilationConfig
    # vLLM's optimization level (-O0..-O3): a default for the mode only, as in vLLM: 0 compiles
    # nothing, 1..3 run mode 3; a mode compilation_config names wins, whatever the order
    optimization_level: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    # vLLM's data parallel: engine core replicas, requests balanced over them (dp_core_client.py)
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None
    data_parallel_backend: str = "mp"
    seed: int | None = 0  # None: a fresh random seed per engine (vLLM's LLM(seed=None))
    load_format: str = "auto"
    block_size: int = 16
    kv_cache_memory: float | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    device: str = "auto"
    revision: str | None = None  # hub revision of a hub-id model
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    skip_tokenizer_init: bool = False
    chat_template: str | None = None  # a Jinja file or the template text
    generation_config: str = "auto"  # auto | vllm | a directory with generation_config.json
    max_logprobs: int = 20  # most (prompt_)logprobs a request may ask for; -1: the vocabulary
    quantization: str | None = None  # "int8": W8A8 on load; a quantized checkpoint sets it
    # auto | hadamard | none (None: none): the residual stream rotated before online int8
    # quantization; auto where it applies (kiln/config/quantization_rotation.py)
    quantization_rotation: str | None = "auto"
    hf_overrides: dict | None = None  # vLLM's: changes to the model's HF config (JSON object)
    # vLLM's: full attention in every layer, max_model_len capped at the model's window
    disable_sliding_window: bool = False
    # vLLM's: one KV block table for every layer of a hybrid sliding-window model (each layer
    # then keeps every block), instead of KV cache groups (kiln/core/kv_cache_groups.py)
    disable_hybrid_kv_cache_manager: bool = False
    enable_sleep_mode: bool = False  # vLLM's: LLM.sleep / wake_up may free KV cache and weights
    ir_op_priority: dict | None = None  # {"rms_norm": ["native", "torch"]}; see kiln/ir/
    # vLLM's: a dict, its JSON text or a SpeculativeConfig; only method "ngram" is served
    speculative_config: Any = None
    # vLLM's arguments that have one meaning here, taken so users' scripts and flags carry over
    # (other values are refused by _check_vllm_only_defaults).
    trust_remote_code: bool = False  # no checkpoint code ever runs: Kiln's own models only
    enable_chunked_prefill: bool | None = None  # None / True: chunked; False: whole prompts
    kv_cache_dtype: str = "auto"  # the model's dtype; fp8 (= fp8_e4m3), fp8_e5m2
    tokenizer_mode: str = "auto"  # a fast (tokenizers) tokenizer; "hf" is the same
    swap_space: float = 4.0  # GiB; unused: preempted requests are recomputed (vLLM V1's way)
    disable_log_stats: bool = False  # kiln serve: no periodic throughput line in the log
    # vLLM's pooling runner (kiln/pooling/): runner "pooling" (or its older task "embed") serves
    # embeddings; pooler_config (older override_pooler_config): {"pooling_type", "normalize",
    # "use_activation"}; convert (or task "classify"): the score head of a classifier
    runner: str = "auto"
    task: str | None = None
    convert: str = "auto"
    pooler_config: Any = None
    override_pooler_config: Any = None
    # vLLM's LoRA knobs (kiln/lora/); the sizes are read only with enable_lora (lm-eval passes
    # max_lora_rank=16 either way)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"  # vLLM's: auto (the model's), float16, bfloat16, float32
    fully_sharded_loras: bool = False  # refused when True (kiln/lora/config.py)

    def __post_init__(self):
        self.dtype = dtype_name(self.dtype)  # so to_cli_args and == see the name too
        self.lora_dtype = dtype_name(self.lora_dtype)
        if self.quantization_rotation is None:  # off, as before "auto"; a name for the CLI
            self.quantization_rotation = "none"

    def compilation(self) -> CompilationConfig:
        """compilation_config with the optimization level's mode where it names none (a copy:
        KilnConfig resolves the mode in it)."""
        level = self.optimization_level
        if level is not None and (isinstance(level, bool) or level not in (0, 1, 2, 3)):
            raise ConfigError(f"optimization_level must be 0, 1, 2 or 3 (vLLM's levels), got "
                              f"{level!r}")
        config = CompilationConfig.from_cli(self.compilation_config)
        if config is self.compilation_config:
            config = dataclasses.replace(config)
        if level is not None and config.mode is None:
            config.mode = CompilationMode.NONE if level == 0 else CompilationMode.KILN_COMPILE
        return config

    def create_kiln_config(self) -> KilnConfig:
        # Cheap checks first so a bad flag fails before the checkpoint is read.
        self._check_types()
        self._check_vllm_only_defaults()
        load_config = LoadConfig(load_format=self.load_format)
        cache_config = CacheConfig(
            block_size=self.block_size, kv_cache_memory=self.kv_cache_memory,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enable_prefix_caching=self.enable_prefix_caching,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            cache_dtype=self.kv_cache_dtype)
        scheduler_config = SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                           max_num_batched_tokens=self.max_num_batched_tokens,
                                           policy=self.scheduling_policy,
                                           enable_chunked_prefill=(
                                               self.enable_chunked_prefill is not False),
                                           disable_hybrid_kv_cache_manager=(
                                               self.disable_hybrid_kv_cache_manager))
        parallel_config = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
            data_parallel_size=self.data_parallel_size,
            data_parallel_size_local=self.data_parallel_size_local,
            data_parallel_backend=self.data_parallel_backend)
        compilation_config = self.compilation()
        check_convert(self.convert)
        runner = resolve_runner(self.runner, self.task, self.convert)
        if runner == "pooling":
            check_pooling_engine(self)
        speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        device_config = DeviceConfig(device=self.device)
        model_config = ModelConfig(model=self.model, tokenizer=self.tokenizer, dtype=self.dtype,
                                   max_model_len=self.max_model_len,
                                   seed=_random_seed() if self.seed is None else self.seed,
                                   load_format=self.load_format, revision=self.revision,
                                   tokenizer_revision=self.tokenizer_revision,
                                   download_dir=self.download_dir,
                                   skip_tokenizer_init=self.skip_tokenizer_init,
                                   chat_template=self.chat_template,
                                   generation_config=self.generation_config,
                                   max_logprobs=self.max_logprobs,
                                   quantization=self.quantization,
                                   quantization_rotation=self.quantization_rotation,
                                   runner_type=runner,
                                   hf_overrides=self.hf_overrides,
                                   disable_sliding_window=self.disable_sliding_window,
                                   enable_sleep_mode=self.enable_sleep_mode)
        if runner == "generate":
            runner = model_config.runner_type = auto_runner(
                self.runner, self.task, runner, model_config.model_path,
                model_config.architecture)
            if runner == "pooling":
                check_pooling_engine(self)
        task = pooling_task(self.convert, self.task, model_config.architecture) \
            if runner == "pooling" else "embed"
        model_config.pooler_config = resolve_pooler_config(
            runner, self.pooler_config, self.override_pooler_config, model_config.model_path,
            task)
        if runner == "pooling" and model_config.pooler_config.pooling_type != "LAST":
            # The prefix cache skips the hidden states MEAN and CLS pool (vLLM's the same).
            cache_config.enable_prefix_caching = False
        return KilnConfig(model_config=model_config, cache_config=cache_config,
                          scheduler_config=scheduler_config, parallel_config=parallel_config,
                          load_config=load_config, device_config=device_config,
                          compilation_config=compilation_config, enforce_eager=self.enforce_eager,
                          ir_op_priority=dict(self.ir_op_priority or {}),
                          speculative_config=speculative_config,
                          lora_config=self.lora_config())

    def lora_config(self):
        if not self.enable_lora:
            return None
        from kiln.lora.config import LoRAConfig

        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                          max_cpu_loras=self.max_cpu_loras, lora_dtype=self.lora_dtype,
                          fully_sharded_loras=self.fully_sharded_loras)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        return add_engine_flags(parser, EngineArgs())

    def to_cli_args(self) -> list[str]:
        """The engine flags that rebuild these arguments in a child `kiln` command (non-default
        fields only): from_cli_args's inverse."""
        default = EngineArgs()
        argv: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value == getattr(default, f.name):
                continue
            flag = "--" + f.name.replace("_", "-")
            if f.name == "compilation_config":
                argv += [flag, json.dumps(spec_to_dict(value))]
            elif f.name == "hf_overrides":
                argv += [flag, json.dumps(value)]
            elif f.name == "speculative_config":
                config = SpeculativeConfig.from_value(value)
                if config is not None:
                    argv += [flag, json.dumps(config.to_dict())]
            elif f.name == "ir_op_priority":
                for op, providers in value.items():
                    argv += [flag, f"{op}={','.join(providers)}"]
            elif f.name in ("pooler_config", "override_pooler_config"):
                continue  # merged into one --pooler-config after the loop
            elif isinstance(value, bool):  # store_true, or --no- of a BooleanOptionalAction
                argv.append(flag if value else "--no-" + flag[2:])
            else:
                argv += [flag, str(value)]
        pooler = pooler_config_json(self.pooler_config, self.override_pooler_config)
        if pooler is not None:
            argv += ["--pooler-config", pooler]
        return argv

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def check_pooling_engine(args: EngineArgs) -> None:
    """What the pooling runner does not do yet, refused by its flag."""
    if args.pipeline_parallel_size != 1:
        raise ConfigError("--runner pooling runs without pipeline parallelism: drop "
                          "--pipeline-parallel-size (tensor parallelism works)")


def _random_seed() -> int:
    """A seed for an engine that was given none: runs differ, as vLLM's do with seed=None."""
    return int.from_bytes(os.urandom(8), "little") >> 1
