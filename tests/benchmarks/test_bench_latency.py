"""`kiln bench latency`: the pure decisions (percentiles, spec merging, plan checks) and real
runs comparing two compilation configs in one process (as a command and in this process)."""
import json
import subprocess
import sys

import pytest

from kiln.benchmarks import latency
from kiln.benchmarks.decode_steps import percentile, summarize_ms, turn_lengths
from kiln.benchmarks.latency import merge_spec, run_latency, speedups
from kiln.benchmarks.latency_subject import check_kv_capacity, check_plan
from kiln.engine.arg_utils import EngineArgs

SMALL = ["--kv-cache-memory", "0.01", "--max-model-len", "64", "--max-num-seqs", "8",
         "--max-num-batched-tokens", "32"]


def test_percentile_interpolates():
    assert percentile([3.0], 90) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 90) == pytest.approx(3.7)
    s = summarize_ms([0.001, 0.003, 0.002])
    assert (s["median_ms"], s["min_ms"], s["max_ms"], s["num_steps"]) == (2.0, 1.0, 3.0, 3)
    assert s["p90_ms"] == pytest.approx(2.8)


def test_merge_spec_item_wins_over_base():
    assert merge_spec(None, "0") == {"mode": 0}
    assert merge_spec('{"mode": 3, "compile_sizes": [1]}', "2") == {"mode": 2,
                                                                     "compile_sizes": [1]}
    assert merge_spec(3, '{"cudagraph_mode": "NONE"}') == {"mode": 3, "cudagraph_mode": "NONE"}
    with pytest.raises(ValueError, match="no_such_field"):
        merge_spec(None, '{"no_such_field": 1}')
    with pytest.raises(ValueError, match="mode"):
        merge_spec(None, "7")
    with pytest.raises(ValueError, match="a mode number, -O.FIELD=VALUE or a JSON object"):
        merge_spec(None, "{bad")


def test_plan_checks_name_the_flag():
    check_plan([1, 8], 32, 10, 3, max_num_seqs=8, max_model_len=128)
    with pytest.raises(ValueError, match="--max-num-seqs"):
        check_plan([1, 16], 32, 10, 3, max_num_seqs=8, max_model_len=128)
    with pytest.raises(ValueError, match="--max-model-len"):
        check_plan([1], 100, 30, 3, max_num_seqs=8, max_model_len=128)
    with pytest.raises(ValueError, match="--batch-sizes"):
        check_plan([0], 4, 1, 0, max_num_seqs=8, max_model_len=128)
    check_kv_capacity(4, 33, num_blocks=12, block_size=16)  # 4 x 3 blocks
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        check_kv_capacity(4, 33, num_blocks=11, block_size=16)


def test_speedups_are_first_over_other():
    first = {"1": {"median_ms": 3.0}, "8": {"median_ms": 6.0}}
    assert speedups(first, {"1": {"median_ms": 1.5}, "8": {"median_ms": 6.0}}) == {"1": 2.0,
                                                                                  "8": 1.0}


def test_turns_cover_every_step():
    assert turn_lengths(10, 4) == [4, 4, 2]
    assert turn_lengths(3, 4) == [3] and turn_lengths(8, 4) == [4, 4]


def test_interleaving_defaults_to_cpu_only():
    assert latency.default_interleave(EngineArgs(device="cpu"))
    assert not latency.default_interleave(EngineArgs(device="cuda"))


def test_enforce_eager_is_refused():
    with pytest.raises(ValueError, match="--enforce-eager"):
        run_latency(EngineArgs(enforce_eager=True), [1], 4, 2)


EAGER_MODE3 = json.dumps({"mode": 3, "backend": "eager"})  # traced and split, no Inductor: fast


@pytest.mark.parametrize("interleave", ["--interleave", "--no-interleave"])
def test_bench_latency_compares_two_configs_in_one_run(tiny_llama_dir, interleave, capsys):
    """`kiln bench latency` through the command's parser and function in this process (an
    interpreter start-up spared: main()'s wrapper and the process's stdout are the -tp 2
    test's, which runs the command)."""
    from kiln.entrypoints.cli.main import build_parser, parse_args

    spec = EAGER_MODE3
    argv = ["bench", "latency", "--model", str(tiny_llama_dir), *SMALL, "--load-format", "dummy",
            "--batch-sizes", "1", "2", "--input-len", "4", "--num-steps", "3",
            "--warmup-steps", "1", "--compare", "0", spec, interleave]
    args = parse_args(build_parser(), argv)
    assert args.func(args) == 0
    (line,) = capsys.readouterr().out.splitlines()
    report = json.loads(line)
    assert report["batch_sizes"] == [1, 2] and report["num_steps"] == 3
    assert report["interleaved"] is (interleave == "--interleave")
    assert report["model_weight_bytes"] > 0
    first, second = report["configs"]
    assert (first["spec"], first["compilation_mode"]) == ("0", 0)
    assert (second["spec"], second["compilation_mode"]) == (spec, 3)
    assert second["compilation_config"] == {"mode": 3, "backend": "eager"}
    for config in report["configs"]:
        assert set(config["results"]) == {"1", "2"}
        for figures in config["results"].values():
            assert figures["num_steps"] == 3
            assert 0 < figures["min_ms"] <= figures["median_ms"] <= figures["p90_ms"]
    assert first["speedup_vs_first"] == {"1": 1.0, "2": 1.0}
    floor = report["linear_floor"]
    if interleave == "--interleave":  # CPU: the floor took its turns beside the engines
        assert set(floor) == {"1", "2"} and all(f["num_steps"] == 3 for f in floor.values())
        for b in ("1", "2"):
            assert report["speedup_ceiling_vs_first"][b] == pytest.approx(
                first["results"][b]["median_ms"] / floor[b]["median_ms"], rel=1e-12)
            for config in report["configs"]:
                assert config["above_linear_floor_ms"][b] == pytest.approx(
                    config["results"][b]["median_ms"] - floor[b]["median_ms"], abs=1e-9)
    else:
        assert floor is None and report["speedup_ceiling_vs_first"] is None
    for b, ratio in second["speedup_vs_first"].items():
        expected = first["results"][b]["median_ms"] / second["results"][b]["median_ms"]
        assert ratio == pytest.approx(expected, rel=1e-12)


def test_bench_latency_with_tensor_parallel_ranks(tiny_llama_dir):
    """-tp 2: the model lives in the ranks, which the report says (it read the in-process
    worker's runner and failed). As a command: main()'s wrapper, stdout the report alone."""
    r = subprocess.run([sys.executable, "-m", "kiln.entrypoints.cli.main", "bench", "latency",
                        "--model", str(tiny_llama_dir), *SMALL, "-tp", "2", "--batch-sizes",
                        "1", "--input-len", "4", "--num-steps", "2", "--warmup-steps", "1",
                        "--compare", "0"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = r.stdout.splitlines()
    report = json.loads(line)
    assert report["model_weight_bytes"] is None
    assert report["configs"][0]["results"]["1"]["num_steps"] == 2


def test_interleaved_engines_take_turns_on_the_same_batch(tiny_llama_dir, monkeypatch):
    turns, real = [], latency.time_steps
    monkeypatch.setattr(latency, "time_steps", lambda engine, n, b, tag: turns.append(
        (id(engine), n, b)) or real(engine, n, b, tag))
    args = EngineArgs(model=str(tiny_llama_dir), load_format="dummy", kv_cache_memory=0.01,
                      max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32)
    report = run_latency(args, [2], 4, 6, ["0", EAGER_MODE3], warmup_steps=1, interleave=True)
    assert report["interleaved"] and report["steps_per_turn"] == latency.STEPS_PER_TURN == 4
    first, second = turns[0][0], turns[1][0]
    assert first != second
    assert turns == [(first, 4, 2), (second, 4, 2), (first, 2, 2), (second, 2, 2)]
    assert [c["results"]["2"]["num_steps"] for c in report["configs"]] == [6, 6]


def test_linear_floor_runs_every_linear_and_the_head(tiny_llama_dir, monkeypatch):
    import torch
    from model._attn_helper import kiln_config_for

    from kiln.benchmarks.linear_floor import LinearFloor, above_floor, speedup_ceiling
    from kiln.model.layers.linear import LinearBase
    from kiln.model.loader import build_model

    model = build_model(kiln_config_for(tiny_llama_dir))
    calls = []
    real_linear, real_head = LinearBase.forward, type(model).compute_logits
    monkeypatch.setattr(LinearBase, "forward", lambda m, x: calls.append((m, x.shape)) or
                        real_linear(m, x))
    monkeypatch.setattr(type(model), "compute_logits", lambda m, h: calls.append(("head",
                        h.shape)) or real_head(m, h))
    floor = LinearFloor(model)
    assert len(floor.time(3, 2)) == 2
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    hidden = model.lm_head.weight.shape[1]
    one_pass = [(m, torch.Size([3, m.weight.shape[1]])) for m in linears] + [
        ("head", torch.Size([3, hidden]))]
    assert calls == one_pass * 2
    def ms(v):
        return {"median_ms": v}

    assert above_floor({"1": ms(5.0)}, {"1": ms(3.5)}) == {"1": 1.5}
    assert speedup_ceiling({"1": ms(5.0)}, {"1": ms(4.0)}) == {"1": 1.25}


def test_linear_floor_feeds_a_quantized_model_its_activation_dtype(tiny_llama_dir):
    import torch
    from model._attn_helper import kiln_config_for

    from kiln.benchmarks.linear_floor import LinearFloor
    from kiln.model.loader import get_model

    model = get_model(kiln_config_for(tiny_llama_dir, quantization="int8"))
    floor = LinearFloor(model)
    assert floor.dtype == torch.float32  # not the int8 weights'
    assert len(floor.time(2, 1)) == 1
