"""`kiln bench serve`'s pure parts: arrivals, prompts, percentiles, flags for the child server."""
import dataclasses
import math

import pytest

from kiln.benchmarks.serve import RequestResult, arrival_delays, percentiles, random_token_prompts, summarize
from kiln.engine.arg_utils import EngineArgs
from kiln.entrypoints.cli.main import build_parser


def test_arrivals_are_poisson_at_the_rate_and_zero_for_inf():
    assert arrival_delays(5, math.inf, 0) == [0.0] * 5
    gaps = arrival_delays(4000, 20.0, 0)
    assert abs(sum(gaps) / len(gaps) - 1 / 20) < 0.005
    assert gaps == arrival_delays(4000, 20.0, 0)  # seeded
    for bad in (0.0, -1.0, -math.inf, math.nan):
        with pytest.raises(ValueError, match="--request-rate must be > 0"):
            arrival_delays(3, bad, 0)


@pytest.mark.parametrize("flags, named", [(["--request-rate", "nan"], "--request-rate"),
                                          (["--server-start-timeout", "-5"],
                                           "--server-start-timeout"),
                                          (["--server-start-timeout", "nan"],
                                           "--server-start-timeout"),
                                          # a running server's: configured already
                                          (["--base-url", "http://127.0.0.1:9", "-tp", "2",
                                            "--enforce-eager"],
                                           "--enforce-eager, --tensor-parallel-size")])
def test_bad_flags_are_refused_before_a_server_starts(flags, named):
    from kiln.entrypoints.cli import bench_serve

    args = build_parser().parse_args(["bench", "serve", *flags])
    with pytest.raises(ValueError, match=named):
        bench_serve.run(args)  # would start `kiln serve` first if it got past the check


@pytest.mark.parametrize("flags, named", [
    (["--graceful-shutdown-timeout", "nan"], "--graceful-shutdown-timeout"),
    (["--graceful-shutdown-timeout", "-1"], "--graceful-shutdown-timeout"),
    (["--served-model-name", ""], "--served-model-name"),
    # bytes that are not UTF-8 (lone surrogates): every response naming the model was a 500
    (["--served-model-name", "ok", "m\udcff"], "--served-model-name 'm.udcff' is not UTF-8"),
    (["--request-body-timeout", "nan"], "--request-body-timeout")])
def test_bad_serve_flags_are_refused_before_the_model_loads(flags, named):
    from kiln.entrypoints.cli.serve import settings_from_args

    with pytest.raises(ValueError, match=named):
        settings_from_args(build_parser().parse_args(["serve", *flags]))
    settings_from_args(build_parser().parse_args(["serve", "--graceful-shutdown-timeout", "0"]))


def test_prompts_have_the_length_and_stay_in_vocab():
    prompts = random_token_prompts(3, 7, 50, seed=1)
    assert [len(p) for p in prompts] == [7, 7, 7]
    assert all(3 <= t < 50 for p in prompts for t in p)


def test_percentiles_in_ms():
    p = percentiles([0.001 * i for i in range(1, 101)])
    assert p["p50"] == 50.5 and p["p99"] == 99.01 and p["mean"] == 50.5
    assert percentiles([]) == {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}


def test_summary_counts_only_completed_requests():
    results = [RequestResult(ok=True, ttft=0.1, itls=[0.01, 0.02], latency=0.2,
                             output_tokens=3),
               RequestResult(ok=False, error="HTTP 500: boom")]
    s = summarize(results, 2.0, {"num_prompts": 2})
    assert (s["completed"], s["failed"], s["errors"]) == (1, 1, ["HTTP 500: boom"])
    assert s["requests_per_s"] == 0.5 and s["output_tokens_per_s"] == 1.5
    assert s["ttft_ms"]["p50"] == 100.0 and s["itl_ms"]["p50"] == 15.0


def test_summary_has_vllm_bench_serve_fields():
    """A script reading `vllm bench serve`'s result (request_throughput, p99_ttft_ms, ...) found
    none of them; TPOT was missing outright (helper-106)."""
    results = [RequestResult(ok=True, ttft=0.1, itls=[0.02], latency=0.14, output_tokens=3,
                             prompt_tokens=8),  # a chunk of two tokens: one ITL, TPOT 20 ms
               RequestResult(ok=True, ttft=0.3, itls=[0.01, 0.01], latency=0.32,
                             output_tokens=3, prompt_tokens=8),
               RequestResult(ok=False, error="HTTP 500: boom")]
    s = summarize(results, 2.0, {"num_prompts": 3})
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (2, 1, 6)
    assert s["duration"] == 2.0 and s["total_input_tokens"] == 16
    assert (s["request_throughput"], s["output_throughput"], s["total_token_throughput"]) == (
        1.0, 3.0, 11.0)
    assert s["mean_ttft_ms"] == pytest.approx(200) and s["median_ttft_ms"] == pytest.approx(200)
    assert s["std_ttft_ms"] == pytest.approx(100) and s["p99_ttft_ms"] == pytest.approx(298)
    assert s["mean_tpot_ms"] == pytest.approx(15) and s["median_itl_ms"] == pytest.approx(10)
    assert s["mean_e2el_ms"] == pytest.approx(230)
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert {f"{stat}_{metric}_ms" for stat in ("mean", "median", "std", "p99")} <= set(s)
    empty = summarize([RequestResult(ok=False, error="x")], 1.0, {})
    assert empty["mean_tpot_ms"] == empty["p99_itl_ms"] == empty["request_throughput"] == 0.0


def test_engine_flags_round_trip_through_kiln_serve_parser():
    ea = EngineArgs(model="/m", enforce_eager=True, max_model_len=256,
                    compilation_config={"mode": 0}, skip_tokenizer_init=True,
                    enable_prefix_caching=False, kv_cache_memory=0.5,
                    ir_op_priority={"rms_norm": ["torch"]})
    argv = ea.to_cli_args()
    args = build_parser().parse_args(["serve", *argv])
    assert EngineArgs.from_cli_args(args) == ea
    bench = build_parser().parse_args(["bench", "serve", "--num-prompts", "3", *argv])
    assert bench.num_prompts == 3 and EngineArgs.from_cli_args(bench) == ea


def test_server_that_dies_at_start_is_one_error_line(monkeypatch, capsys):
    import subprocess
    import sys

    from kiln.entrypoints.cli import bench_serve

    popen = subprocess.Popen
    monkeypatch.setattr(bench_serve.subprocess, "Popen", lambda cmd, **kw: popen(
        [sys.executable, "-c", "raise SystemExit(2)"]))
    args = build_parser().parse_args(["bench", "serve", "--model", "/m", "--num-prompts", "1"])
    assert bench_serve.run(args) == 1
    err = capsys.readouterr().err
    assert "error: `kiln serve` exited with code 2 before it was ready" in err


def test_the_server_dies_with_a_killed_bench(monkeypatch):
    """kill -9 of `kiln bench serve` (the OOM killer, a cancelled job) left the `kiln serve` it
    started running, holding its port and cores: the server is started to get SIGTERM when the
    bench dies."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from kiln.entrypoints.cli import bench_serve
    from kiln.process_signals import die_with_parent

    seen, popen = {}, subprocess.Popen
    monkeypatch.setattr(bench_serve.subprocess, "Popen", lambda cmd, **kw: seen.update(kw) or
                        popen([sys.executable, "-c", "raise SystemExit(2)"]))
    bench_serve.run(build_parser().parse_args(["bench", "serve", "--model", "/m",
                                               "--num-prompts", "1"]))
    assert seen["preexec_fn"] is die_with_parent
    # the mechanism: a parent that starts a sleeper so, then dies of SIGKILL
    code = ("import subprocess, sys, time; from kiln.process_signals import die_with_parent; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], "
            "preexec_fn=die_with_parent); print(p.pid, flush=True); time.sleep(300)")
    parent = popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        try:  # reaped by init, or a zombie of it: either way gone once /proc says so
            if open(f"/proc/{child}/stat").read().split()[2] == "Z":
                break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the child outlived its killed parent")


def test_stall_record_tells_a_request_s_own_gaps_from_the_waits_between_requests():
    from kiln.benchmarks.stall_probe import StreamRecord

    record = StreamRecord([[0.0, 0.01, 0.02], [0.10, 0.11, 0.15], [0.16]])
    gaps = [round(g, 3) for g in record.gaps(0.0, 1.0)]
    assert gaps == [0.01, 0.01, 0.08, 0.01, 0.04, 0.01]  # across requests too
    within = [round(g, 3) for g in record.gaps_within_requests(0.0, 1.0)]
    assert within == [0.01, 0.01, 0.01, 0.04]  # the 80 ms before request 2 is not a stream gap
    assert [round(g, 3) for g in record.gaps_within_requests(0.05, 0.12)] == [0.01]
    assert record.largest_gap_start(0.0, 1.0) == 0.02
    starts = [(round(a, 3), round(g, 3)) for a, g in record.gap_starts(0.09, 0.2)]
    assert starts == [(0.1, 0.01), (0.11, 0.04), (0.15, 0.01)]


def test_a_round_reports_each_phase_s_gaps_and_the_teardown_apart():
    from kiln.benchmarks.stall_probe import Phases, StreamRecord, round_report

    # idle 0-1 s: tokens every 10 ms but one 30 ms gap; load 1-2 s, held until 1.8 s: one
    # 60 ms gap; the hang-ups at 1.8 s: a 100 ms gap that spans them
    idle = [i * 0.01 for i in range(50)] + [0.52 + i * 0.01 for i in range(48)]
    loaded = [1.0 + i * 0.01 for i in range(40)] + [1.45 + i * 0.01 for i in range(30)]
    teardown = [1.79, 1.89]
    record = StreamRecord([idle, loaded + teardown])
    load = {"intervals": [(1.095, 1.305)], "held_until": 1.8, "opened": 7, "churned": 3,
            "niceness": 19}
    report = round_report(record, Phases(0.0, 1.0, 2.0, load))
    assert report["idle"]["max_gap_ms"] == pytest.approx(30.0)
    assert report["loaded"]["max_gap_ms"] == pytest.approx(60.0)
    assert report["max_gap_ratio"] == pytest.approx(2.0)
    assert report["teardown"]["max_gap_ms"] == pytest.approx(100.0)
    assert report["tokens_during_big_requests"] == 21  # 1.10 .. 1.30
    assert report["loaded"]["max_gap_at_s"] == pytest.approx(0.39)


def test_the_report_is_the_median_round_s():
    from kiln.benchmarks.stall_probe import median_round

    assert median_round([1.5]) == 0
    # a round in which the machine paused (8.9 or 0.2: a pause in either phase) moves no report
    assert median_round([1.6, 8.9, 1.4, 0.2, 1.8]) == 0
    assert median_round([2.0, 1.0, 3.0, 4.0]) == 0  # the lower middle of an even count
    assert median_round([None, 1.2, 1.1]) == 1  # no idle tokens: the worst
    with pytest.raises(ValueError, match="no rounds"):
        median_round([])


def test_probe_rounds_must_be_positive():
    from kiln.entrypoints.cli.bench_serve import run

    args = build_parser().parse_args(["bench", "serve", "--stall-probe", "--probe-rounds", "0"])
    with pytest.raises(ValueError, match="--probe-rounds must be >= 1, got 0"):
        run(args)


def test_the_load_process_waits_for_go_after_ready():
    import json
    import subprocess
    import sys

    from kiln.benchmarks.stall_probe import LoadSpec

    spec = dict(base_url="http://127.0.0.1:9", headers={}, model="m", duration=0.1,
                load=dataclasses.asdict(LoadSpec(tokenize_bytes=100, prompt_400_bytes=100)))
    proc = subprocess.run([sys.executable, "-m", "kiln.benchmarks.stall_load"],
                          input=json.dumps(spec) + "\nstop\n", capture_output=True, text=True,
                          timeout=60)
    # ready once its bodies are built; anything but `go` ends it before any load is sent
    assert proc.stdout.splitlines() == ["ready"], proc.stdout
    assert proc.returncode != 0 and "expected `go`" in proc.stderr


@pytest.mark.parametrize("var", ["KILN_API_KEY", "VLLM_API_KEY"])
def test_the_key_in_the_environment_is_sent(monkeypatch, var):
    """`KILN_API_KEY=k kiln bench serve`: the server it starts reads the variable and turns its
    key on, so a client that read only --api-key got a 401 for every request."""
    from kiln.benchmarks import serve
    from kiln.entrypoints.cli import bench_serve

    monkeypatch.delenv("KILN_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setenv(var, "sekrit")
    seen = {}

    async def fake_benchmark(*args, api_key=None, **kw):
        seen["api_key"] = api_key
        return {"failed": 0}

    monkeypatch.setattr(serve, "run_benchmark", fake_benchmark)
    args = build_parser().parse_args(["bench", "serve", "--base-url", "http://127.0.0.1:9",
                                      "--num-prompts", "1"])
    assert bench_serve.run(args) == 0
    assert seen["api_key"] == "sekrit"
    # an explicit --api-key still wins
    args = build_parser().parse_args(["bench", "serve", "--base-url", "http://127.0.0.1:9",
                                      "--api-key", "other"])
    bench_serve.run(args)
    assert seen["api_key"] == "other"
