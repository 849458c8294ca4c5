"""The engine's command-line flags (`kiln generate/chat/serve/bench/compile`): one per EngineArgs
field, with vLLM's names, help and the -O / --ir-op-priority parsers that merge repeated values.
"""
import argparse
import re
from typing import TYPE_CHECKING

from kiln.attention.kv_cache_dtype import CACHE_DTYPES
from kiln.config.compilation_config import cli_fields, level_as_mode, merged_fields
from kiln.config.hf_overrides import parse_hf_overrides
from kiln.config.load_config import LOAD_FORMATS
from kiln.config.quantization_rotation import CHOICES as ROTATION_CHOICES
from kiln.engine.vllm_flags import add_vllm_only_flags, max_model_len_flag

if TYPE_CHECKING:
    from kiln.engine.arg_utils import EngineArgs

MODES_HELP = ("0: eager, no compilation; 1: plain torch.compile with its guards; 2: one "
              "Dynamo trace, guards dropped; 3: Kiln's piecewise stack, split at attention, "
              "compiled per shape and cached on disk (the default)")


def compilation_fields(text: str, flag: str = "-O/--compilation-config") -> dict:
    """The fields one -O value (or a bench --compare item) sets, its mistakes said in the
    flag's terms: a number that is no mode, or a bad one under vLLM's older name "level"."""
    stripped = text.strip()
    if re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", stripped) and (
            not stripped.isdigit() or int(stripped) > 3):
        raise ValueError(f"{flag}: the compilation mode must be 0, 1, 2 or 3, got {stripped} "
                         f"({MODES_HELP})")
    # vLLM's older name "level" is read as "mode", as vLLM still does (a later -O's level
    # then sets the mode over an earlier -O's)
    fields_ = cli_fields(text)
    try:
        return level_as_mode(fields_)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


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


def hf_overrides_flag(text: str) -> dict:
    """--hf-overrides JSON: argparse names the flag and says what is wrong with the JSON."""
    try:
        return parse_hf_overrides(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--hf-overrides ")) from None


def add_engine_flags(parser: argparse.ArgumentParser,
                     d: "EngineArgs") -> argparse.ArgumentParser:
    """Add every engine flag to `parser`, each defaulting to its field in `d`."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=d.model,
                   help="local HF checkpoint directory or .gguf file, or a Hugging Face hub "
                        "id (org/name; org/repo:Q4_K_M for one GGUF file of a repo), looked "
                        "up in the hub cache first (default: built-in model)")
    # read by kiln.entrypoints.cli.config_file before parsing; here for --help
    g.add_argument("--config", metavar="YAML",
                   help="flags from a YAML file, as vLLM's --config: a mapping of flag names "
                        "to values (max-model-len: 4096, enforce-eager: true); flags on the "
                        "command line win")
    g.add_argument("--tokenizer", default=d.tokenizer,
                   help="tokenizer directory, .gguf or hub id (default: the model's)")
    g.add_argument("--revision", default=d.revision,
                   help="hub revision (branch, tag or commit) of a hub-id --model")
    g.add_argument("--tokenizer-revision", default=d.tokenizer_revision,
                   help="hub revision of a hub-id --tokenizer")
    g.add_argument("--download-dir", default=d.download_dir,
                   help="hub cache directory to look in and download to (default: "
                        "HF_HUB_CACHE or HF_HOME/hub)")
    # vLLM's boolean engine flags take --no-FLAG too (BooleanOptionalAction)
    g.add_argument("--skip-tokenizer-init", action=argparse.BooleanOptionalAction,
                   default=d.skip_tokenizer_init,
                   help="load no tokenizer: prompts are token ids, outputs carry no text")
    g.add_argument("--enable-sleep-mode", action=argparse.BooleanOptionalAction,
                   default=d.enable_sleep_mode,
                   help="let the engine sleep (free its KV cache, and its weights at level 2) "
                        "and wake up: LLM.sleep / wake_up, and POST /sleep, /wake_up under "
                        "KILN_SERVER_DEV_MODE=1")
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
    g.add_argument("--max-model-len", type=max_model_len_flag, default=d.max_model_len,
                   help="context length (prompt + output), as vLLM takes it: 4096, 32k "
                        "(32000) or 32K (32768); -1 or auto: the model's, lowered to what the "
                        "KV cache holds (also the default)")
    g.add_argument("--hf-overrides", type=hf_overrides_flag, default=d.hf_overrides,
                   metavar="JSON",
                   help="changes to the model's Hugging Face config, as vLLM's: a JSON object "
                        "('{\"rope_theta\": 1000000}'); a key naming a sub-config merges "
                        "into it, any other key replaces the value")
    g.add_argument("--disable-sliding-window", action=argparse.BooleanOptionalAction,
                   default=d.disable_sliding_window,
                   help="attend fully in every layer of a sliding-window model (Mistral, "
                        "Gemma-2, ...), as vLLM's flag: max_model_len is then capped at the "
                        "window")
    g.add_argument("--disable-hybrid-kv-cache-manager", action=argparse.BooleanOptionalAction,
                   default=d.disable_hybrid_kv_cache_manager,
                   help="as vLLM's: a hybrid sliding-window model (Gemma-2/3) keeps every KV "
                        "block in every layer instead of freeing its window layers' blocks "
                        "behind the window")
    g.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                   help="most logprobs (and prompt_logprobs) a request may ask for; -1: "
                        "the whole vocabulary")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="most sequences in one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="token budget of one step")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"],
                   default=d.scheduling_policy,
                   help="the order requests are served in: fcfs (arrival; a request's "
                        "priority is ignored, as vLLM V1 does) or priority (a lower request "
                        "priority first, then arrival; a full KV cache preempts the running "
                        "request with the largest priority)")
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction,
                   default=d.enforce_eager,
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
    g.add_argument("--data-parallel-size", "-dp", type=int, default=d.data_parallel_size,
                   help="engine replicas on this machine, each with its own -tp x -pp ranks; "
                        "requests go to the least loaded one")
    g.add_argument("--data-parallel-size-local", "-dpl", type=int,
                   default=d.data_parallel_size_local,
                   help="replicas on this machine: all of them (multi-node is not built)")
    g.add_argument("--data-parallel-backend", "-dpb", default=d.data_parallel_backend,
                   choices=["mp", "ray"],  # vLLM's; ray is refused by ParallelConfig
                   help="how replicas run: mp (one process each); ray is not built")
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
                   choices=["int8", "fp8", "ptpc_fp8", "compressed-tensors", "gptq", "awq"],
                   help="int8: quantize the float checkpoint's linear layers on load (W8A8: "
                        "per-channel int8 weights, dynamic per-token int8 activations); "
                        "fp8 / ptpc_fp8: the same in e4m3 with per-tensor / per-channel "
                        "weight scales (fast on GPUs with fp8 tensor cores); a "
                        "compressed-tensors, GPTQ or AWQ checkpoint needs no flag")
    g.add_argument("--quantization-rotation", default=d.quantization_rotation,
                   choices=ROTATION_CHOICES,
                   help="with --quantization int8: rotate a Llama-style model's residual "
                        "stream by a fixed orthogonal matrix (Hadamard x seeded random, "
                        "QuaRot-style, no calibration) before quantizing, which spreads its "
                        "outlier channels and brings int8's perplexity closer to the float "
                        "model's; auto (default): where it applies (online int8, Llama / "
                        "Mistral / Qwen2 / Qwen3 / Granite / ERNIE-4.5 / Seed-OSS / SmolLM3 / "
                        "Phi-3, -pp 1, no LoRA, no EAGLE, the generate runner), else none; "
                        "hadamard: refused where it does not apply")
    g.add_argument("--speculative-config", default=d.speculative_config, metavar="JSON",
                   help="speculative decoding, as vLLM's: '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4, "
                        "\"prompt_lookup_min\": 2}' (prompt lookup) or '{\"method\": "
                        "\"draft_model\", \"model\": \"path/to/small-model\", "
                        "\"num_speculative_tokens\": 3}' (a draft model with the target's "
                        "vocabulary) or '{\"method\": \"eagle\", \"model\": "
                        "\"path/to/eagle-head\", \"num_speculative_tokens\": 3}' (an "
                        "EAGLE-1 head for a Llama target; method \"eagle3\": an EAGLE-3 "
                        "head); other methods are refused")
    g.add_argument("--ir-op-priority", dest="ir_op_priority", action=_IrOpPriority,
                   default=d.ir_op_priority, metavar="OP=PROVIDER[,PROVIDER...]",
                   help="providers of an IR op in order of preference, e.g. "
                        "rms_norm=native,torch (repeatable; kiln compile reports the choice)")
    g.add_argument("--runner", default=d.runner, choices=["auto", "generate", "pooling"],
                   help="pooling: serve embeddings (/v1/embeddings, LLM.embed), or a "
                        "classifier's scores (/classify, /score, /rerank), instead of "
                        "generating text")
    g.add_argument("--task", default=d.task,
                   choices=["auto", "generate", "embed", "classify", "score"],
                   help="vLLM's older name of --runner: embed, classify and score are "
                        "--runner pooling (classify: --convert classify)")
    g.add_argument("--convert", default=d.convert, choices=["auto", "none", "embed", "classify"],
                   help="what the pooling runner computes: embed (hidden states) or classify "
                        "(the checkpoint's score head; a *ForSequenceClassification "
                        "checkpoint's default)")
    g.add_argument("--pooler-config", "--override-pooler-config", dest="pooler_config",
                   default=d.pooler_config, metavar="JSON",
                   help="the pooling runner's pooler, e.g. '{\"pooling_type\": \"MEAN\", "
                        "\"normalize\": true}' (LAST, MEAN or CLS; default: the checkpoint's "
                        "sentence-transformers pooling, else LAST, normalized)")
    g.add_argument("--enable-lora", action=argparse.BooleanOptionalAction,
                   default=d.enable_lora,
                   help="serve LoRA adapters (PEFT directories: --lora-modules, or a "
                        "request's lora_request) on the q/k/v/o and gate/up/down projections")
    g.add_argument("--max-loras", type=int, default=d.max_loras,
                   help="LoRA adapters one batch may use at once (device slots, LRU)")
    g.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank,
                   help="the largest LoRA rank (r) an adapter may have")
    g.add_argument("--max-cpu-loras", type=int, default=d.max_cpu_loras,
                   help="LoRA adapters kept in host memory (default: --max-loras)")
    g.add_argument("--lora-dtype", default=d.lora_dtype,
                   choices=["auto", "float16", "bfloat16", "float32"],
                   help="the dtype LoRA adapters are held and applied in (auto: the model's)")
    g.add_argument("--fully-sharded-loras", action=argparse.BooleanOptionalAction,
                   default=d.fully_sharded_loras,
                   help="vLLM's fully sharded LoRA under tensor parallelism; not supported "
                        "(Kiln shards each adapter weight on its layer's split dimension)")
    v = parser.add_argument_group(
        "vLLM flags with one meaning here (taken so commands carry over)",
        "vLLM flags Kiln has no counterpart for (--kv-cache-memory-bytes, "
        "--api-server-count, ...) are refused with the reason and what to use instead")
    v.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction,
                   default=d.trust_remote_code,
                   help="accepted; Kiln runs no code from checkpoints (its own model "
                        "classes only)")
    v.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=d.enable_chunked_prefill,
                   help="prompts longer than what is left of a step's token budget are "
                        "prefilled in chunks (the default); --no-enable-chunked-prefill "
                        "prefills each in one step (--max-num-batched-tokens then defaults to "
                        "at least --max-model-len)")
    v.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=list(CACHE_DTYPES),
                   help="the KV cache's elements: auto (the model's dtype; fp8 over a "
                        "compressed-tensors checkpoint with a kv_cache_scheme), fp8 (= fp8_e4m3, "
                        "float8_e4m3fn) or fp8_e5m2: half a bfloat16 cache's bytes; scaled by the "
                        "checkpoint's per-layer k_scale / v_scale (read under a "
                        "compressed-tensors config or online fp8 / int8, as vLLM), else 1.0")
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
