"""`kiln bench latency`: per-step decode latency at fixed batch sizes for several compilation
configs in one invocation (default: mode 0 vs mode 3); prints one JSON line.
"""
import argparse
import json

from kiln.engine.arg_utils import EngineArgs
from kiln.engine.vllm_flags import VllmFlag, add_vllm_only_flags

_STEPS = ("Kiln's bench latency times single decode steps of a full batch, not whole requests: "
          "give --num-steps (timed steps) and --warmup-steps")
# `vllm bench latency` times whole batches of requests end to end; its flags for that, refused
# with what to give here (they were unknown, `--output-len` said "did you mean --output-json?").
VLLM_LATENCY_FLAGS = (
    VllmFlag(("--output-len",), "tokens generated per request", _STEPS),
    VllmFlag(("--num-iters",), "timed batches", _STEPS),
    VllmFlag(("--num-iters-warmup",), "untimed batches", _STEPS),
    VllmFlag(("--n",), "sequences per prompt", "Kiln's bench latency decodes one per request: "
             "--batch-sizes sets how many decode together"),
)


def register_bench(kinds) -> None:
    parser = kinds.add_parser(
        "latency", help="decode latency per engine step, compilation configs compared",
        description="For each config in --compare and each batch size: add that many random "
                    "prompts of --input-len tokens, step until all decode, then time --num-steps "
                    "decode steps (LLMEngine.step). Reports median/p90 ms per step and each "
                    "config's speedup over the first. On CPU every config's engine is built up "
                    "front and they take turns of 4 timed steps (--no-interleave: one engine "
                    "at a time, the GPU default).")
    parser.add_argument("--batch-sizes", "--batch-size", type=int, nargs="+", default=[1, 8, 32],
                        help="requests decoding together in each measured step, one "
                             "measurement per size")
    parser.add_argument("--input-len", type=int, default=32,
                        help="prompt tokens of each request")
    parser.add_argument("--num-steps", type=int, default=32, help="timed decode steps per batch")
    parser.add_argument("--warmup-steps", type=int, default=3,
                        help="untimed decode steps before the timed ones")
    parser.add_argument("--compare", nargs="+", default=None, metavar="SPEC",
                        help="compilation configs to compare, each a mode or CompilationConfig "
                             "JSON applied on top of -O, e.g. --compare 0 3 or --compare "
                             "'{\"mode\":3,\"cudagraph_mode\":\"NONE\"}' "
                             "'{\"mode\":3,\"cudagraph_mode\":\"FULL_AND_PIECEWISE\"}' "
                             "(default: 0 3)")
    parser.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                        help="engines side by side, taking turns (default: on CPU only); "
                             "every engine and its KV cache are held at once, which "
                             "--kv-cache-memory bounds")
    EngineArgs.add_cli_args(parser)
    add_vllm_only_flags(parser, VLLM_LATENCY_FLAGS)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kiln.benchmarks.latency import run_latency
    from kiln.config import CompilationConfig
    from kiln.engine.engine_flags import compilation_fields

    for item in args.compare or []:  # named as --compare, not as compilation_config
        try:
            CompilationConfig.from_cli(compilation_fields(item, flag=f"--compare {item}"))
        except ValueError as e:
            message = str(e)
            raise ValueError(message if message.startswith("--compare ")
                             else f"--compare {item}: {message}") from None
    report = run_latency(EngineArgs.from_cli_args(args), args.batch_sizes, args.input_len,
                         args.num_steps, args.compare, args.warmup_steps,
                         args.interleave)
    print(json.dumps(report), flush=True)
    return 0
