"""`kiln bench compile`: the child command and environment it builds, and (slow) a real cold
then warm start in two processes."""
import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.benchmarks.compile import child_env, run_compile_bench, start_figures
from kiln.config import CompilationConfig
from kiln.config.compilation_config import spec_to_dict
from kiln.engine.arg_utils import EngineArgs

# Every engine argument away from its default (a new field must be added here).
NON_DEFAULT = dict(
    model="/m", tokenizer="/t", dtype="bfloat16", max_model_len=64, max_num_seqs=4,
    max_num_batched_tokens=128, enforce_eager=True,
    compilation_config='{"mode": 3, "compile_sizes": [1, 8]}', optimization_level=2,
    tensor_parallel_size=2,
    pipeline_parallel_size=2, distributed_executor_backend="mp", data_parallel_size=2,
    data_parallel_size_local=2, data_parallel_backend="mp", seed=7, load_format="dummy",
    block_size=32, kv_cache_memory=0.5, gpu_memory_utilization=0.5,
    enable_prefix_caching=False, num_gpu_blocks_override=10, device="cpu", revision="r",
    tokenizer_revision="tr", download_dir="/d", skip_tokenizer_init=True, chat_template="t",
    generation_config="vllm", max_logprobs=5, quantization="int8", quantization_rotation="hadamard",
    ir_op_priority={"rms_norm": ["torch"], "linear": ["native", "torch"]},
    trust_remote_code=True, enable_chunked_prefill=True, kv_cache_dtype="fp8",
    tokenizer_mode="hf", swap_space=2.0, disable_log_stats=True, scheduling_policy="priority",
    hf_overrides={"rms_norm_eps": 1e-5}, disable_sliding_window=True, runner="pooling",
    disable_hybrid_kv_cache_manager=True,
    task="embed", convert="embed",
    pooler_config='{"pooling_type": "MEAN", "normalize": false}',
    override_pooler_config='{"pooling_type": "CLS", "normalize": true}',
    speculative_config='{"method": "ngram", "num_speculative_tokens": 2}',
    enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3,
    lora_dtype="bfloat16", fully_sharded_loras=True, enable_sleep_mode=True)


def test_engine_args_round_trip_through_the_cli():
    """to_cli_args is from_cli_args' inverse for every field (kiln bench compile/serve start
    children with it: a bool flag given a value, or an op priority as JSON, failed them)."""
    assert set(NON_DEFAULT) == {f.name for f in dataclasses.fields(EngineArgs)}
    args = EngineArgs(**NON_DEFAULT)
    argv = args.to_cli_args()
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    back = EngineArgs.from_cli_args(parser.parse_args(argv))
    assert spec_to_dict(back.compilation_config) == {"mode": 3, "compile_sizes": [1, 8]}
    back.compilation_config = args.compilation_config
    # JSON-valued fields come back in their canonical form: the speculative config with its
    # defaults filled in, the two pooler configs (one flag destination) merged into one
    assert back == dataclasses.replace(
        args, speculative_config='{"method": "ngram", "num_speculative_tokens": 2, '
                                 '"prompt_lookup_max": 5, "prompt_lookup_min": 5}',
        pooler_config='{"pooling_type": "MEAN", "normalize": false}', override_pooler_config=None)
    assert EngineArgs().to_cli_args() == []


def test_both_pooler_configs_reach_a_child_merged_as_the_engine_merges_them():
    """--pooler-config and vLLM's older --override-pooler-config share one flag destination:
    writing both into a child's command line kept the last (the older name's) whole."""
    args = EngineArgs(model="/m", runner="pooling", pooler_config='{"pooling_type": "MEAN"}',
                      override_pooler_config='{"pooling_type": "CLS", "normalize": false}')
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    back = EngineArgs.from_cli_args(parser.parse_args(args.to_cli_args()))
    assert json.loads(back.pooler_config) == {"pooling_type": "MEAN", "normalize": False}


def test_spec_to_dict_accepts_every_form():
    assert spec_to_dict(None) == {}
    assert spec_to_dict(3) == spec_to_dict("3") == {"mode": 3}
    assert spec_to_dict({"backend": "eager"}) == {"backend": "eager"}
    full = spec_to_dict(CompilationConfig(mode=3, compile_sizes=[4]))
    assert full["mode"] == 3 and full["compile_sizes"] == [4]
    assert CompilationConfig.from_cli(full).compile_sizes == [4]
    with pytest.raises(ValueError, match="JSON must be an object"):
        spec_to_dict("[1]")


def test_child_env_keeps_inductor_cache_visible(tmp_path, monkeypatch):
    monkeypatch.delenv("KILN_DISABLE_COMPILE_CACHE", raising=False)
    env = child_env({"TRITON_CACHE_DIR": "/elsewhere", "PATH": "/bin"}, tmp_path)
    assert Path(env["TORCHINDUCTOR_CACHE_DIR"]).parent == tmp_path
    assert "TRITON_CACHE_DIR" not in env and env["PATH"] == "/bin"
    monkeypatch.setenv("KILN_DISABLE_COMPILE_CACHE", "1")
    with pytest.raises(ValueError, match="KILN_DISABLE_COMPILE_CACHE"):
        child_env({}, tmp_path)


def test_mode0_is_refused():
    with pytest.raises(ValueError, match="-O0"):
        run_compile_bench(EngineArgs(compilation_config=0))


def test_start_figures_split_compile_from_load():
    report = {"times": {"total_s": 10.0, "load_model_s": 1.0, "warmup_s": 8.0, "trace_s": 1.0,
                        "compile_s": 6.0, "artifact_load_s": 0.5},
              "inductor": {"compiles": 3, "artifacts_loaded": 0, "artifacts_saved": 3},
              "cache": {"hits": 0, "misses": 3, "dirs": {"/c": "miss"}}}
    f = start_figures(report, 12.0)
    assert (f["startup_s"], f["process_wall_s"], f["torch_compile_s"]) == (10.0, 12.0, 7.5)
    assert (f["compile_s"], f["artifact_load_s"], f["num_inductor_compiles"]) == (6.0, 0.5, 3)
    assert "draft" not in f
    draft = {"times": {"trace_s": 0.5, "compile_s": 2.0, "load_s": 0.0},
             "inductor": {"compiles": 2, "artifacts_loaded": 0},
             "cache": {"hits": 0, "misses": 2}}
    f = start_figures({**report, "draft": draft}, 12.0)  # the target's figures, its own apart
    assert f["torch_compile_s"] == 7.5 and f["draft"] == {
        "torch_compile_s": 2.5, "num_inductor_compiles": 2, "num_compiled_artifacts_loaded": 0,
        "cache_hits": 0, "cache_misses": 2}


@pytest.mark.slow
def test_bench_compile_cold_then_warm(tiny_llama_dir):
    r = subprocess.run([sys.executable, "-m", "kiln.entrypoints.cli.main", "bench", "compile",
                        "--model", str(tiny_llama_dir), "--kv-cache-memory", "0.01",
                        "--max-model-len", "64", "--max-num-seqs", "8",
                        "--max-num-batched-tokens", "32"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = r.stdout.splitlines()
    report = json.loads(line)
    cold, warm = report["cold"], report["warm"]
    assert report["pieces"] == {"total": 5, "compiled": 3, "graphs": 1}
    assert cold["num_inductor_compiles"] >= 1 and cold["compile_s"] > 0
    assert cold["num_compiled_artifacts_saved"] == cold["num_inductor_compiles"]
    assert warm["num_inductor_compiles"] == 0 and warm["compile_s"] == 0
    assert warm["num_compiled_artifacts_loaded"] == cold["num_compiled_artifacts_saved"]
    assert list(cold["cache_dirs"].values()) == ["miss"]
    assert list(warm["cache_dirs"].values()) == ["hit"]
    assert cold["cache_dirs"].keys() == warm["cache_dirs"].keys()
    assert report["warm_vs_cold_startup"] == pytest.approx(
        warm["startup_s"] / cold["startup_s"], rel=1e-12)
    assert report["inductor_files_outside_kiln_cache"] == 0  # Inductor's cache under Kiln's
    assert not Path(report["cache_dir"]).exists()  # removed without --keep-cache
