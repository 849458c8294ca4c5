"""Data parallel's decisions without a model: which replica takes a request (fewest waiting, then
running, as vLLM's DPLB client), a replica's load between steps, stats over replicas, and each
replica's devices and cores."""
import pytest

from kiln.config import ParallelConfig
from kiln.core.stats import SchedulerStats
from kiln.distributed.cpu_binding import check_binding, replica_binding
from kiln.engine.dp_balance import pick_replica, replica_load
from kiln.engine.dp_core_client import merged_stats, replica_placement
from kiln.errors import ConfigError


def test_fewest_waiting_then_fewest_running():
    assert pick_replica([(2, 0), (1, 5), (1, 3)]) == 2
    assert pick_replica([(0, 9), (1, 0)]) == 0  # waiting first: a queue means a slow start
    assert pick_replica([(0, 1), (0, 0)]) == 1


def test_ties_go_in_turn_from_start():
    assert pick_replica([(0, 0)] * 3) == 0
    assert pick_replica([(0, 0)] * 3, start=2) == 2
    assert pick_replica([(0, 0), (1, 0), (0, 0)], start=1) == 2  # the next tied one after 1
    with pytest.raises(ValueError, match="no data-parallel replica"):
        pick_replica([])


def test_load_counts_unseen_adds_as_waiting_and_is_capped_by_what_is_unfinished():
    assert replica_load(0, 2, unseen_adds=3, num_unfinished=5) == (3, 2)
    # a cancelled stream: the stats (from before its abort) still count it, the front end not
    assert replica_load(0, 1, unseen_adds=0, num_unfinished=0) == (0, 0)
    assert replica_load(2, 2, unseen_adds=0, num_unfinished=3) == (1, 2)


def test_stats_add_up_and_keep_each_replica():
    a = SchedulerStats(num_running=2, num_waiting=1, kv_cache_usage=0.5, num_total_blocks=100,
                       num_free_blocks=50, prefix_cache_queries=10, prefix_cache_hits=4,
                       spec_decode_num_accepted_tokens_per_pos=[3, 1],
                       running_lora_adapters=["x", "y"])
    b = SchedulerStats(num_running=1, kv_cache_usage=0.0, num_total_blocks=300,
                       num_free_blocks=300, prefix_cache_queries=5,
                       spec_decode_num_accepted_tokens_per_pos=[2],
                       running_lora_adapters=["y"])
    m = merged_stats([a, b])
    assert (m.num_running, m.num_waiting, m.num_total_blocks, m.num_free_blocks) == (3, 1, 400,
                                                                                     350)
    assert m.kv_cache_usage == pytest.approx(50 / 400)
    assert m.prefix_cache_hit_rate == pytest.approx(4 / 15)
    assert m.spec_decode_num_accepted_tokens_per_pos == [5, 1]
    assert m.running_lora_adapters == ["x", "y"]
    d = m.to_dict()
    assert [e["num_running"] for e in d["engines"]] == [2, 1]


class _Config:
    def __init__(self, device: str, dp: int, tp: int = 1):
        import torch

        self.parallel_config = ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp,
                                              distributed_executor_backend="mp" if tp > 1
                                              else None)
        self.device_config = type("D", (), {"device_obj": torch.device(device)})()


def test_cuda_replicas_get_their_own_devices():
    config = _Config("cuda", dp=2, tp=2)
    devices = ["0", "1", "2", "3"]
    assert replica_placement(1, config, [0, 1], 0, devices) == ({"CUDA_VISIBLE_DEVICES": "2,3"},
                                                                None)
    with pytest.raises(ConfigError, match="needs 4 GPUs, 3 visible; lower --data-parallel"):
        replica_placement(0, config, [0, 1], 0, devices[:3])


def test_cpu_replicas_split_the_cores_left_to_them(monkeypatch):
    monkeypatch.delenv("KILN_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    config = _Config("cpu", dp=2)
    cores = list(range(8))
    # one core for the front end, the other seven shared out (three each)
    assert replica_placement(0, config, cores, 1, None) == ({}, [0, 1, 2])
    assert replica_placement(1, config, cores, 1, None) == ({}, [3, 4, 5])
    # two cores, two replicas: one each, none left to keep for the front end
    assert replica_placement(1, config, [0, 1], 1, None) == ({}, [1])
    monkeypatch.setenv("KILN_CPU_OMP_THREADS_BIND", "nobind")
    assert replica_placement(1, config, cores, 1, None) == ({}, None)


def test_core_lists_are_split_between_replicas(monkeypatch):
    """vLLM-CPU's rule: replica d's rank r takes list d * world_size + r; a list of the wrong
    length names the variable and the count needed."""
    assert replica_binding("0-1|2-3|4-5|6-7", 1, 2, 2) == "4-5|6-7"
    assert replica_binding("0|1", 0, 1, 2) == "0|1"  # no data parallel: as it is
    assert replica_binding("auto", 1, 2, 2) == "auto"
    monkeypatch.delenv("KILN_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1|2-3")
    with pytest.raises(ConfigError, match=r"VLLM_CPU_OMP_THREADS_BIND='0-1\|2-3' gives 2 core "
                       r"list\(s\); --data-parallel-size 2 x 2 rank\(s\) per replica needs 4"):
        replica_binding("0-1|2-3", 0, 2, 2)
    # a one-process replica is pinned to its list; a multi-rank one's ranks read theirs
    config = _Config("cpu", dp=2)
    assert replica_placement(1, config, list(range(8)), 1, None) == (
        {"KILN_CPU_OMP_THREADS_BIND": "2-3"}, [2, 3])
    config = _Config("cpu", dp=2, tp=2)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1|2|3")
    assert replica_placement(1, config, list(range(8)), 1, None) == (
        {"KILN_CPU_OMP_THREADS_BIND": "2|3"}, None)
    with pytest.raises(ConfigError, match="needs 4"):
        check_binding("0|1", 2, 2)


def test_parallel_config_refuses_multi_node_and_ray_replicas():
    assert ParallelConfig(data_parallel_size=2).world_size_across_dp == 2
    with pytest.raises(ConfigError, match="multi-node data parallel is not built"):
        ParallelConfig(data_parallel_size=4, data_parallel_size_local=2)
    with pytest.raises(ConfigError, match=r"--data-parallel-backend \(data_parallel_backend\) "
                       "'ray' is not built.*use mp"):
        ParallelConfig(data_parallel_size=2, data_parallel_backend="ray")
    with pytest.raises(ConfigError, match="data_parallel_size must be an integer >= 1"):
        ParallelConfig(data_parallel_size=0)


def test_the_ray_backend_flag_is_refused_by_kilns_message():
    """argparse's choices error ("invalid choice: 'ray'") named no reason and no way out."""
    from kiln.engine.arg_utils import EngineArgs
    from kiln.entrypoints.cli.main import build_parser

    args = build_parser().parse_args(["generate", "hi", "--model", "/nowhere", "-dp", "2",
                                      "--data-parallel-backend", "ray"])
    with pytest.raises(ConfigError, match=r"--data-parallel-backend .*'ray' is not built"):
        EngineArgs.from_cli_args(args).create_kiln_config()
