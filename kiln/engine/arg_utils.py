"""`EngineArgs`: every engine knob with vLLM's names, its CLI flags, and the KilnConfig it builds.

The LLM class, the CLI and the server all build their configuration through this one dataclass.
"""
import argparse
import dataclasses
import json
import os
import re
import typing
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
from kiln.config.compilation_config import (
    CompilationMode,
    cli_fields,
    merged_fields,
    spec_to_dict,
)
from kiln.config.load_config import LOAD_FORMATS
from kiln.engine.vllm_flags import add_vllm_only_flags, human_readable_int
from kiln.errors import ConfigError

_DEFAULT_MAX_NUM_SEQS = SchedulerConfig.__dataclass_fields__["max_num_seqs"].default


MODES_HELP = ("0: eager, no compilation; 1: plain torch.compile with its guards; 2: one "
              "Dynamo trace, guards dropped; 3: Kiln's piecewise stack, split at attention, "
              "compiled per shape and cached on disk (the default)")


def compilation_fields(text: str, flag: str = "-O/--compilation-config") -> dict:
    """The fields one -O value (or a bench --compare item) sets, its mistakes said in the
    flag's terms: a number that is no mode, and vLLM's older name "level" for "mode"."""
    stripped = text.strip()
    if re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", stripped) and (
            not stripped.isdigit() or int(stripped) > 3):
        raise ValueError(f"{flag}: the compilation mode must be 0, 1, 2 or 3, got {stripped} "
                         f"({MODES_HELP})")
    fields_ = cli_fields(text)
    if "level" in fields_:
        raise ValueError(f"{flag}: 'level' is vLLM's older name for 'mode'; write "
                         f"{json.dumps({'mode': fields_['level']})}")
    return fields_


class _MergeCompilationConfig(argparse.Action):
    """-O / --compilation-config, repeatable: each value (a mode number, -O.FIELD=VALUE or a
    JSON object) updates the fields given before it, so `-O '{"compile_sizes": [4]}' -O3` keeps
    the sizes, and -O.pass_config.X=false -O.pass_config.Y=false sets both."""

    def __call__(self, parser, namespace, value, option_string=None):
        try:
            update = compilation_fields(value)
        except ValueError as e:
            parser.error(str(e))
        current = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest,
                merged_fields(current if isinstance(current, dict) else {}, update))


class _IrOpPriority(argparse.Action):
    """--ir-op-priority OP=PROVIDER[,...], repeatable: each one sets its op's list."""

    def __call__(self, parser, namespace, value, option_string=None):
        from kiln.ir import parse_cli

        try:
            update = parse_cli([value])
        except ValueError as e:
            parser.error(str(e))
        current = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, {**(current or {}), **update})


@dataclass
class EngineArgs:
    model: str | None = None  # None: the embedded default model
    tokenizer: str | None = None  # None: the model's own tokenizer
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = _DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    compilation_config: Any = None  # int | dict | str (mode or JSON) | CompilationConfig
    # vLLM's optimization level (-O0..-O3): a default for the mode only, as in vLLM: 0 compiles
    # nothing, 1..3 run mode 3; a mode compilation_config names wins, whatever the order
    optimization_level: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
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
    ir_op_priority: dict | None = None  # {"rms_norm": ["native", "torch"]}; see kiln/ir/
    # vLLM's arguments that have one meaning here, taken so users' scripts and flags carry over
    # (other values are refused by _check_vllm_only_defaults).
    trust_remote_code: bool = False  # no checkpoint code ever runs: Kiln's own models only
    enable_chunked_prefill: bool | None = None  # prompts longer than a step's budget are chunked
    kv_cache_dtype: str = "auto"  # the model's dtype
    tokenizer_mode: str = "auto"  # a fast (tokenizers) tokenizer; "hf" is the same
    swap_space: float = 4.0  # GiB; unused: preempted requests are recomputed (vLLM V1's way)
    disable_log_stats: bool = False  # kiln serve: no periodic throughput line in the log

    def _check_types(self) -> None:
        """A value of the wrong type names its argument (LLM(max_model_len="64") used to fail
        deep inside a config)."""
        def fits(value, kind) -> bool:
            if kind is type(None):
                return value is None
            if kind is bool:
                return isinstance(value, bool)
            if kind is int:
                return isinstance(value, int) and not isinstance(value, bool)
            if kind is float:
                return isinstance(value, (int, float)) and not isinstance(value, bool)
            return isinstance(value, kind)

        for name in ("model", "tokenizer", "download_dir", "chat_template",
                     "generation_config"):  # a pathlib.Path is a path too
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        for f in fields(self):
            if f.type is Any:
                continue
            kinds = typing.get_args(f.type) or (f.type,)
            value = getattr(self, f.name)
            if not any(fits(value, kind) for kind in kinds):
                names = " or ".join("None" if k is type(None) else k.__name__ for k in kinds)
                raise ValueError(f"{f.name} must be {names}, got {value!r} "
                                 f"({type(value).__name__})")

    def _check_vllm_only_defaults(self) -> None:
        if self.enable_chunked_prefill is False:
            raise ValueError("enable_chunked_prefill=False is not supported: a prompt longer "
                             "than --max-num-batched-tokens is always prefilled in chunks; to "
                             "prefill each prompt in one step, raise --max-num-batched-tokens "
                             "to --max-model-len")
        if self.kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported: the KV "
                             "cache holds the model's dtype ('auto')")
        if self.tokenizer_mode not in ("auto", "hf"):
            raise ValueError(f"tokenizer_mode={self.tokenizer_mode!r} is not supported: the "
                             "model's fast tokenizer is used ('auto' or 'hf')")
        if not self.swap_space >= 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")

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
            num_gpu_blocks_override=self.num_gpu_blocks_override)
        scheduler_config = SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                           max_num_batched_tokens=self.max_num_batched_tokens)
        parallel_config = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend)
        compilation_config = self.compilation()
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
                                   quantization=self.quantization)
        return KilnConfig(model_config=model_config, cache_config=cache_config,
                          scheduler_config=scheduler_config, parallel_config=parallel_config,
                          load_config=load_config, device_config=device_config,
                          compilation_config=compilation_config, enforce_eager=self.enforce_eager,
                          ir_op_priority=dict(self.ir_op_priority or {}))

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        d = EngineArgs()
        g = parser.add_argument_group("engine")
        g.add_argument("--model", default=d.model,
                       help="local HF checkpoint directory or .gguf file, or a Hugging Face hub "
                            "id (org/name; org/repo:Q4_K_M for one GGUF file of a repo), looked "
                            "up in the hub cache first (default: built-in model)")
        g.add_argument("--tokenizer", default=d.tokenizer,
                       help="tokenizer directory, .gguf or hub id (default: the model's)")
        g.add_argument("--revision", default=d.revision,
                       help="hub revision (branch, tag or commit) of a hub-id --model")
        g.add_argument("--tokenizer-revision", default=d.tokenizer_revision,
                       help="hub revision of a hub-id --tokenizer")
        g.add_argument("--download-dir", default=d.download_dir,
                       help="hub cache directory to look in and download to (default: "
                            "HF_HUB_CACHE or HF_HOME/hub)")
        g.add_argument("--skip-tokenizer-init", action="store_true",
                       default=d.skip_tokenizer_init,
                       help="load no tokenizer: prompts are token ids, outputs carry no text")
        g.add_argument("--chat-template", default=d.chat_template,
                       help="a Jinja chat template replacing the tokenizer's: a file, or the "
                            "template itself")
        g.add_argument("--generation-config", default=d.generation_config,
                       help="sampling defaults for unset request fields: 'auto' (the model's "
                            "generation_config.json), 'vllm' (none) or a directory holding a "
                            "generation_config.json")
        g.add_argument("--dtype", default=d.dtype,
                       choices=["auto", "float32", "float", "bfloat16", "float16", "half"],
                       help="weights' and activations' dtype; auto: the platform's default "
                            "(float32 on CPU), or on CUDA the checkpoint's float16/bfloat16")
        g.add_argument("--max-model-len", type=human_readable_int, default=d.max_model_len,
                       help="context length (prompt + output), as vLLM takes it: 4096, 32k "
                            "(32000) or 32K (32768); default: the model's")
        g.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                       help="most logprobs (and prompt_logprobs) a request may ask for; -1: "
                            "the whole vocabulary")
        g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                       help="most sequences in one step")
        g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                       help="token budget of one step")
        g.add_argument("--enforce-eager", action="store_true", default=d.enforce_eager,
                       help="run eagerly: no torch.compile, no graphs")
        g.add_argument("-O", "--compilation-config", dest="compilation_config",
                       default=d.compilation_config, action=_MergeCompilationConfig,
                       help="compilation mode (" + MODES_HELP + ") or "
                            "CompilationConfig JSON (-O '{\"mode\": 3, \"compile_sizes\": "
                            "[1, 8]}'; given more than once, later fields override earlier "
                            "ones; vLLM's -O.FIELD=VALUE too). -O0..-O3 and -O N are "
                            "--optimization-level N, not the mode: --compilation-config N is")
        g.add_argument("--optimization-level", dest="optimization_level", type=int,
                       choices=[0, 1, 2, 3], default=d.optimization_level,
                       help="vLLM's optimization level (-O0..-O3): 0 compiles nothing, 1..3 run "
                            "mode 3; a mode the compilation config names wins")
        g.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                       help="ranks that split each layer (heads, MLP, vocab)")
        g.add_argument("--pipeline-parallel-size", "-pp", type=int,
                       default=d.pipeline_parallel_size,
                       help="stages that split the layers (one batch in flight at a time)")
        g.add_argument("--distributed-executor-backend", default=d.distributed_executor_backend,
                       choices=["uni", "mp", "ray"],
                       help="how ranks run: uni (in-process, one rank), mp (one process per "
                            "rank; the default for more than one), ray (Ray actors)")
        g.add_argument("--seed", type=int, default=d.seed,
                       help="random seed of the engine (dummy weights, sampling without a "
                            "request seed); kiln generate/chat also seed their sampling with it")
        g.add_argument("--load-format", default=d.load_format, choices=list(LOAD_FORMATS),
                       help="how weights are read: auto (by the files found), safetensors, gguf, "
                            "or dummy (random weights in the model's shapes, for benchmarks)")
        g.add_argument("--block-size", type=int, default=d.block_size,
                       help="tokens per KV cache block (the prefix cache's unit)")
        g.add_argument("--kv-cache-memory", type=float, default=d.kv_cache_memory,
                       help="GiB for the KV cache: host memory on CPU; on CUDA, device "
                            "memory in place of --gpu-memory-utilization's share")
        g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                       help="CUDA: the share of the GPU's memory the engine may use (weights, "
                            "activations, KV cache)")
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=d.enable_prefix_caching,
                       help="reuse the KV cache of prompt prefixes earlier requests computed")
        g.add_argument("--num-gpu-blocks-override", type=int, default=d.num_gpu_blocks_override,
                       help="KV cache blocks to allocate, whatever the memory sizing says "
                            "(default: sized from memory)")
        g.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"],
                       help="where the model runs; auto: CUDA if available, else CPU")
        g.add_argument("--quantization", "-q", default=d.quantization,
                       choices=["int8", "fp8", "ptpc_fp8", "compressed-tensors"],
                       help="int8: quantize the float checkpoint's linear layers on load (W8A8: "
                            "per-channel int8 weights, dynamic per-token int8 activations); "
                            "fp8 / ptpc_fp8: the same in e4m3 with per-tensor / per-channel "
                            "weight scales (fast on GPUs with fp8 tensor cores); a "
                            "compressed-tensors checkpoint needs no flag")
        g.add_argument("--ir-op-priority", dest="ir_op_priority", action=_IrOpPriority,
                       default=d.ir_op_priority, metavar="OP=PROVIDER[,PROVIDER...]",
                       help="providers of an IR op in order of preference, e.g. "
                            "rms_norm=native,torch (repeatable; kiln compile reports the choice)")
        v = parser.add_argument_group(
            "vLLM flags with one meaning here (taken so commands carry over)",
            "vLLM flags Kiln has no counterpart for (--enable-lora, --speculative-config, "
            "-dp, ...) are refused with the reason and what to use instead")
        v.add_argument("--trust-remote-code", action="store_true", default=d.trust_remote_code,
                       help="accepted; Kiln runs no code from checkpoints (its own Llama, "
                            "Qwen2 and Qwen3 only)")
        v.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                       default=d.enable_chunked_prefill,
                       help="long prompts are always prefilled in chunks (--no-... is refused)")
        v.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=["auto"],
                       help="the KV cache holds the model's dtype")
        v.add_argument("--tokenizer-mode", default=d.tokenizer_mode, choices=["auto", "hf"],
                       help="the model's fast tokenizer")
        v.add_argument("--swap-space", type=float, default=d.swap_space,
                       help="GiB; unused: preempted requests are recomputed, as in vLLM V1")
        v.add_argument("--disable-log-stats", action="store_true", default=d.disable_log_stats,
                       help="kiln serve: no periodic throughput line in the log")
        # vLLM's AsyncEngineArgs flag (its serve and bench throughput take it); no field here
        v.add_argument("--disable-log-requests", action="store_true",
                       help="accepted: request contents are never logged")
        add_vllm_only_flags(parser)
        return parser

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
            elif f.name == "ir_op_priority":
                for op, providers in value.items():
                    argv += [flag, f"{op}={','.join(providers)}"]
            elif isinstance(value, bool):  # store_true, or --no- of a BooleanOptionalAction
                argv.append(flag if value else "--no-" + flag[2:])
            else:
                argv += [flag, str(value)]
        return argv

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def _random_seed() -> int:
    """A seed for an engine that was given none: runs differ, as vLLM's do with seed=None."""
    return int.from_bytes(os.urandom(8), "little") >> 1
