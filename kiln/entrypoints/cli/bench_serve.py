"""`kiln bench serve`: the online benchmark against --base-url, or against a `kiln serve` it
starts itself with the given engine flags; prints one JSON line.
"""
import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

from kiln import envs
from kiln.engine.arg_utils import EngineArgs
from kiln.executor.free_port import free_port
from kiln.process_signals import die_with_parent


def register_bench(kinds) -> None:
    parser = kinds.add_parser(
        "serve", help="online serving benchmark over HTTP",
        description="Streaming clients on loopback send random-token prompts at a Poisson rate; "
                    "reports requests/s, output tokens/s, TTFT and ITL percentiles as JSON.")
    parser.add_argument("--base-url", default=None,
                        help="a running server (default: start `kiln serve` with the engine flags)")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests to send")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second (Poisson); inf sends all at once")
    parser.add_argument("--input-len", "--random-input-len", type=int, default=128,
                        help="tokens of each random prompt")
    parser.add_argument("--output-len", "--random-output-len", type=int, default=128,
                        help="tokens generated for each request")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="most requests in flight at once (default: no limit)")
    parser.add_argument("--prompt-seed", dest="bench_seed", type=int, default=0,
                        help="seed of the prompts and arrival times (--seed is the engine's)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="prompt token ids are drawn below this (default: ask the server)")
    parser.add_argument("--api-key", default=None,
                        help="the server's API key (sent as a Bearer token; passed to the "
                             "server this benchmark starts; default: KILN_API_KEY, else "
                             "VLLM_API_KEY, which the server reads too)")
    parser.add_argument("--stall-probe", action="store_true",
                        help="instead: one steady stream alone, then beside front-end load (4 MB "
                             "/tokenize bodies, 4 MB prompts that end in 400, 1000 idle and 200 "
                             "churning connections); report its largest inter-token gaps")
    parser.add_argument("--probe-duration", type=float, default=10.0,
                        help="seconds of each stall-probe phase")
    parser.add_argument("--probe-rounds", type=int, default=1,
                        help="stall probe: rounds of (idle phase, load phase) on one stream; the "
                             "report is the median round's (a pause of the whole machine, "
                             "which either phase may catch, then moves one round)")
    parser.add_argument("--stall-load-niceness", type=int, default=0,
                        help="OS niceness added to the stall probe's load process (0-19; 19: "
                             "clients that yield the server's cores, as remote ones would)")
    parser.add_argument("--stall-id-prompt-clients", type=int, default=0,
                        help="stall probe: clients also posting 4 MB prompts of token ids that "
                             "end in 400 (not in the default load)")
    parser.add_argument("--server-start-timeout", type=float, default=600.0,
                        help="seconds the started server has to become ready")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run)


class ServerStartError(RuntimeError):
    """The server the benchmark started never became ready (its log says why)."""


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerStartError(f"`kiln serve` exited with code {proc.returncode} before "
                                   "it was ready; see its log above")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise ServerStartError(f"`kiln serve` not ready after {timeout:.0f} s; raise "
                           "--server-start-timeout")


def run(args: argparse.Namespace) -> int:
    from kiln.benchmarks.serve import check_request_rate, run_benchmark

    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
    check_request_rate(args.request_rate)  # before a server starts
    if not 0 < args.server_start_timeout < float("inf"):
        raise ValueError(f"--server-start-timeout must be a finite number of seconds > 0, got "
                         f"{args.server_start_timeout}")
    if not args.probe_duration > 0:
        raise ValueError(f"--probe-duration must be > 0 seconds, got {args.probe_duration}")
    if args.probe_rounds < 1:
        raise ValueError(f"--probe-rounds must be >= 1, got {args.probe_rounds}")
    if not 0 <= args.stall_load_niceness <= 19:
        raise ValueError(f"--stall-load-niceness must be in 0..19, got {args.stall_load_niceness}")
    if args.stall_id_prompt_clients < 0:
        raise ValueError("--stall-id-prompt-clients must be >= 0, got "
                         f"{args.stall_id_prompt_clients}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    engine_flags = EngineArgs.from_cli_args(args).to_cli_args()
    # The server started here inherits the environment, so it turns KILN_API_KEY (or
    # VLLM_API_KEY) on by itself: the client must send it too, or every request is a 401.
    args.api_key = args.api_key or envs.api_key()
    if args.base_url is not None:
        # --model names the served model in each request; the rest would configure a server
        # that is already running, and were dropped without a word
        given = [f for f in engine_flags if f.startswith("--") and f != "--model"]
        if given:
            seed = (" (vllm bench's --seed, which seeds the prompts, is --prompt-seed here)"
                    if "--seed" in given else "")
            raise ValueError(f"{', '.join(given)}: engine flags configure the server `kiln "
                             "bench serve` starts; with --base-url it is already running "
                             f"(drop them, or drop --base-url){seed}")
    proc = None
    base_url = args.base_url
    if base_url is None:
        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "kiln.entrypoints.cli.main", "serve", "--port", str(port),
               "--disable-access-log", *engine_flags]
        if args.stall_probe:  # its 4 MB bodies, past the default 4 MiB limit with the JSON
            cmd += ["--max-request-body-bytes", str(8 << 20)]
        if args.api_key:
            cmd += ["--api-key", args.api_key]
        print("starting: " + " ".join(cmd), file=sys.stderr, flush=True)
        # a SIGKILLed bench (the OOM killer, a cancelled CI job) must not leave it serving
        proc = subprocess.Popen(cmd, stdout=sys.stderr, env=os.environ.copy(),
                                preexec_fn=die_with_parent)
    try:
        if proc is not None:
            try:
                _wait_healthy(base_url, proc, args.server_start_timeout)
            except ServerStartError as e:  # one line, not a traceback: the log above says why
                print(f"error: {e}", file=sys.stderr)
                return 1
        if args.stall_probe:
            from kiln.benchmarks.stall_probe import LoadSpec, run_probe

            report = asyncio.run(run_probe(base_url, duration=args.probe_duration,
                                           load=LoadSpec(
                                               niceness=args.stall_load_niceness,
                                               id_prompt_400_clients=args.stall_id_prompt_clients),
                                           api_key=args.api_key, model=args.model,
                                           rounds=args.probe_rounds))
            report["failed"] = 0  # a failed probe raises
        else:
            report = asyncio.run(run_benchmark(
                base_url, args.num_prompts, args.input_len, args.output_len, args.request_rate,
                args.max_concurrency, seed=args.bench_seed, api_key=args.api_key,
                vocab_size=args.vocab_size, model=args.model))
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(json.dumps(report), flush=True)
    return 0 if report["failed"] == 0 else 1
