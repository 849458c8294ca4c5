"""`kiln bench throughput`: offline throughput on random prompts; prints one JSON line.

`--backend hf` also times HF transformers generate on the same prompts and adds the ratio;
`--compare-unquantized` times the same engine without `--quantization` and adds those ratios
(`--rounds N`: alternated rounds, the median reported).
"""
import argparse
import importlib
import json

from kiln.engine.arg_utils import EngineArgs
from kiln.engine.vllm_flags import VLLM_BENCH_FLAGS, add_vllm_only_flags

# Other benchmarks: modules whose register_bench(kinds) adds their parser under `kiln bench`.
BENCHMARKS = [
    "kiln.entrypoints.cli.bench_latency",
    "kiln.entrypoints.cli.bench_compile",
    "kiln.entrypoints.cli.bench_serve",
    "kiln.entrypoints.cli.bench_startup",
]


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks",
                                  description="Benchmarks; see `kiln bench throughput -h`.")
    kinds = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    parser = kinds.add_parser("throughput", help="offline throughput on random prompts",
                              description="Offline throughput on seeded random-token prompts "
                                          "with a fixed output length (ignore_eos; sampled at "
                                          "--temperature 1.0 as vLLM's, seeded by --seed).")
    parser.add_argument("--num-prompts", type=int, default=64, help="prompts in the batch")
    # vLLM's random dataset names them --random-input-len / --random-output-len (as bench serve)
    parser.add_argument("--input-len", "--random-input-len", type=int, default=128,
                        help="tokens of each random prompt")
    parser.add_argument("--output-len", "--random-output-len", type=int, default=128,
                        help="tokens generated for each prompt")
    parser.add_argument("--backend", choices=["kiln", "hf"], default="kiln",
                        help="hf: also run HF transformers generate and report kiln/hf")
    parser.add_argument("--compare-unquantized", action="store_true",
                        help="with --quantization: also run the same prompts unquantized and "
                             "report speedup_vs_unquantized and weight_bytes_vs_unquantized")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with --compare-unquantized: build both engines first, then "
                             "alternate this many rounds on fresh prompts and report the "
                             "median round (for hosts whose speed drifts)")
    # vLLM's bench throughput samples every request at temperature 1.0, top_p 1.0 (ignore_eos)
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="every engine's sampling temperature (vLLM's bench: 1.0; 0: "
                             "greedy); --seed seeds the prompts and the samples")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="every engine's top_p (vLLM's bench: 1.0)")
    parser.add_argument("--multiprocess", action="store_true",
                        help="the engine core in its own process, as LLM runs it by default "
                             "(default: in this process, which also reports weight bytes and "
                             "communication figures)")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run)
    for name in BENCHMARKS:
        importlib.import_module(name).register_bench(kinds)
    for each in kinds.choices.values():  # `vllm bench`'s dataset and result-file flags
        add_vllm_only_flags(each, VLLM_BENCH_FLAGS)
    bench.set_defaults(func=lambda args: bench.print_help() or 2)


def run(args: argparse.Namespace) -> int:
    from kiln.benchmarks.throughput import run_throughput

    report = run_throughput(EngineArgs.from_cli_args(args), args.num_prompts, args.input_len,
                            args.output_len, args.backend, args.compare_unquantized,
                            args.multiprocess, args.rounds, args.temperature, args.top_p)
    print(json.dumps(report), flush=True)
    return 0
