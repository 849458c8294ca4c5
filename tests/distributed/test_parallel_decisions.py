"""The pure decisions behind multi-rank engines: config and flags, rank layout, stage layer
ranges, per-rank CPU cores, whether a model splits, Ray ranks' local indices."""
import argparse

import pytest

from kiln.config.parallel_config import ParallelConfig, resolve_executor_backend
from kiln.distributed.cpu_binding import bind_this_process, cores_for_rank, parse_core_list
from kiln.distributed.model_split import parallel_split_errors
from kiln.distributed.parallel_state import group_ranks
from kiln.distributed.pipeline import stage_layer_range
from kiln.engine.arg_utils import EngineArgs
from kiln.errors import ConfigError
from kiln.executor.ray_placement import kiln_env_vars, local_ranks, node_visible_devices


def test_backend_defaults_to_mp_past_one_rank_and_refuses_uni_there():
    assert resolve_executor_backend(None, 1) == "uni"
    assert resolve_executor_backend(None, 2) == "mp"
    assert resolve_executor_backend("ray", 4) == "ray"
    # without Ray: said before any engine process starts (it came from the core, with its
    # traceback and the command's, seconds in; helper-62)
    with pytest.raises(ConfigError, match=r"'ray' needs Ray: pip install 'kiln-llm\[ray\]'"):
        resolve_executor_backend("ray", 2, has_ray=False)
    with pytest.raises(ConfigError, match="'uni' runs one rank.*--distributed-executor-backend"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ConfigError, match="pipeline_parallel_size must be an integer >= 1"):
        ParallelConfig(pipeline_parallel_size=0)


def test_rank_layout_is_stage_major():
    pc = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=3)
    assert pc.world_size == 6
    assert [(pc.for_rank(r).pp_rank, pc.for_rank(r).tp_rank) for r in range(6)] == \
        [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert group_ranks(2, 3) == ([[0, 1], [2, 3], [4, 5]], [[0, 2, 4], [1, 3, 5]])


def test_flags_use_vllm_names():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["-tp", "2", "-pp", "3", "--distributed-executor-backend", "ray"]))
    assert (args.tensor_parallel_size, args.pipeline_parallel_size,
            args.distributed_executor_backend) == (2, 3, "ray")
    assert EngineArgs.from_cli_args(parser.parse_args(
        ["--pipeline-parallel-size", "2"])).pipeline_parallel_size == 2


def test_stage_layer_ranges_cover_every_layer_once():
    assert [stage_layer_range(30, s, 2) for s in range(2)] == [(0, 15), (15, 30)]
    assert [stage_layer_range(7, s, 3) for s in range(3)] == [(0, 3), (3, 5), (5, 7)]
    with pytest.raises(ConfigError, match="exceeds num_hidden_layers"):
        stage_layer_range(2, 0, 3)


def test_cores_split_evenly_or_follow_the_lists():
    assert cores_for_rank("auto", 0, 2, [0, 1, 2, 3]) == [0, 1]
    assert cores_for_rank("auto", 1, 2, [0, 1, 2, 3]) == [2, 3]
    assert cores_for_rank("auto", 2, 3, [0, 1]) == [0]  # more ranks than cores: shared
    assert cores_for_rank("nobind", 0, 2, [0, 1]) is None
    assert cores_for_rank("0-1,4|2-3", 0, 2, [0]) == [0, 1, 4]
    assert parse_core_list("2-3") == [2, 3]
    with pytest.raises(ConfigError, match="gives 3 core list.*for 2 ranks"):
        cores_for_rank("0|1|2", 0, 2, [0, 1])
    with pytest.raises(ConfigError, match="'x' .* is not a core number"):
        parse_core_list("0,x")
    # a repeat was one more thread on a core already taken (helper-51)
    for repeats in ("0,0,0", "0-2,1"):
        with pytest.raises(ConfigError, match="lists core [01] more than once"):
            parse_core_list(repeats)


def test_binding_to_a_core_the_machine_lacks_names_it():
    """sched_setaffinity's bare "OSError: Invalid argument" reached the user from a rank's
    start-up (helper-26)."""
    import os

    missing = max(os.sched_getaffinity(0)) + 1000
    with pytest.raises(ConfigError, match=rf"KILN_CPU_OMP_THREADS_BIND='0\|{missing}': rank 1's "
                                          rf"cores \[{missing}\] are not available"):
        bind_this_process(f"0|{missing}", 1, 2)


def test_a_bad_binding_is_refused_before_any_rank_starts(monkeypatch, kiln_logs):
    """Checked in each rank, a bad list was every rank's traceback, stacked; with one process
    it was ignored without a word (helper-42)."""
    import os

    from kiln.engine.arg_utils import EngineArgs

    from checkpoints import STORIES_DIR

    missing = max(os.sched_getaffinity(0)) + 1000
    monkeypatch.setenv("KILN_CPU_OMP_THREADS_BIND", f"0|{missing}")
    with pytest.raises(ConfigError, match=rf"rank 1's cores \[{missing}\] are not available"):
        EngineArgs(model=str(STORIES_DIR), device="cpu", pipeline_parallel_size=2,
                   distributed_executor_backend="mp").create_kiln_config()
    monkeypatch.setenv("KILN_CPU_OMP_THREADS_BIND", "0")
    EngineArgs(model=str(STORIES_DIR), device="cpu").create_kiln_config()
    assert "KILN_CPU_OMP_THREADS_BIND='0' is ignored" in kiln_logs.text
    # data parallel: one list per rank of every replica (vLLM-CPU's), checked at config time
    with pytest.raises(ConfigError, match="KILN_CPU_OMP_THREADS_BIND='0' gives 1 core list"):
        EngineArgs(model=str(STORIES_DIR), device="cpu",
                   data_parallel_size=2).create_kiln_config()


def test_model_split_errors_name_the_field():
    class Cfg:
        num_attention_heads, num_key_value_heads = 9, 3
        intermediate_size, num_hidden_layers = 1536, 30

    errors = parallel_split_errors(Cfg, 2, 1)  # SmolLM2-135M over 2 ranks
    assert any("num_attention_heads (9)" in e for e in errors)
    assert any("num_key_value_heads (3)" in e for e in errors)
    assert parallel_split_errors(Cfg, 3, 2) == []
    assert parallel_split_errors(Cfg, 1, 2) == []
    assert "num_hidden_layers (30)" in parallel_split_errors(Cfg, 1, 31)[0]


def test_a_draft_that_does_not_split_is_refused_naming_it(tiny_llama_dir, tmp_path):
    """A draft model is sharded over the target's ranks: one whose heads do not split was
    refused by a rank's layer build, naming neither the draft nor the flag."""
    import json

    from kiln.distributed.model_split import check_parallel_split

    config = json.loads((tiny_llama_dir / "config.json").read_text())
    config.update(hidden_size=48, num_attention_heads=3, num_key_value_heads=1)
    (tmp_path / "config.json").write_text(json.dumps(config))
    def config(draft):
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
        return EngineArgs(model=str(tiny_llama_dir), tensor_parallel_size=2, max_model_len=64,
                          speculative_config=spec).create_kiln_config()

    check_parallel_split(config(tiny_llama_dir))  # 4 heads, 2 KV heads: split
    with pytest.raises(ConfigError, match=r"the draft speculative_config.model='.*' "
                       r"\(LlamaForCausalLM\) runs sharded over the target's "
                       r"--tensor-parallel-size 2 ranks and cannot: num_attention_heads "
                       r"\(3\) is not divisible"):
        check_parallel_split(config(tmp_path))


def test_ray_local_ranks_follow_node_ips():
    assert local_ranks(["a", "a", "b", "b"]) == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert local_ranks(["a", "b", "a"]) == [(0, 2), (0, 1), (1, 2)]


def test_ray_ranks_on_cuda_see_every_gpu_ray_gave_their_machine():
    # Ray shows a 1-GPU actor only its own GPU (as cuda:0); a rank opens cuda:<local rank>, so
    # each must see all of its machine's, in one order on every rank of that machine.
    assert node_visible_devices(["a", "a", "b", "b"], [["1"], ["0"], ["0"], ["3"]]) == \
        ["0,1", "0,1", "0,3", "0,3"]
    assert node_visible_devices(["a", "a", "a"], [["10"], ["9"], ["2"]]) == ["2,9,10"] * 3
    assert node_visible_devices(["a"], [["GPU-u1"]]) == ["GPU-u1"]


def test_ray_rank_actors_get_the_engines_kiln_settings_but_not_its_api_key():
    # (a runtime_env is shown to whoever lists the cluster's actors)
    assert kiln_env_vars({"KILN_CPU_OMP_THREADS_BIND": "nobind", "KILN_API_KEY": "secret",
                          "HOME": "/root"}) == {"KILN_CPU_OMP_THREADS_BIND": "nobind"}


def test_comm_figures_are_per_step_and_per_rank():
    from kiln.benchmarks.comm_figures import comm_figures

    assert comm_figures(None) == {}
    stats = {"scheduler_output_broadcasts": 4, "scheduler_output_broadcast_s": 0.002,
             "ranks": [{"rank": 0, "scheduler_output_unpickle_s": 0.004,
                        "comm": {"all_reduce": {"seconds": 0.04, "calls": 20},
                                 "all_gather": {"seconds": 0.008, "calls": 4}}}]}
    figures = comm_figures(stats)
    assert figures["steps"] == 4
    assert figures["scheduler_output_send_ms_per_step"] == 0.5
    rank = figures["ranks"]["0"]
    assert rank["by_kind"]["all_reduce"] == {"ms_per_step": 10.0, "calls_per_step": 5.0}
    assert rank["collectives_ms_per_step"] == 12.0
    assert rank["scheduler_output_unpickle_ms_per_step"] == 1.0


def test_a_rank_cache_dir_names_its_stage_under_pipeline_parallelism():
    from kiln.compilation.cache import rank_dir_name, rank_dir_of
    from kiln.config import ParallelConfig

    assert rank_dir_name(1, 1, 0) == "rank_1"  # tensor parallel only: one stage
    assert rank_dir_name(3, 2, 1) == "rank_3_stage_1"
    pc = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2).for_rank(2)
    assert rank_dir_of(pc) == "rank_2_stage_1"
