"""Sizes no machine could hold, and seeds torch cannot take, are refused by flag before anything
is built (helper-42: a numpy MemoryError deep in the core, an OOM kill after 3 minutes, a bare
OSError, and "Overflow when unpacking long long")."""
import pytest

from kiln.config import memory_estimate as mem
from kiln.engine.arg_utils import EngineArgs
from kiln.errors import ConfigError

from checkpoints import STORIES_DIR


def test_check_fits_names_the_biggest_setting():
    mem.check_fits({"--a 1": 10, "--b 2": 20}, total_bytes=30)  # fits
    with pytest.raises(ConfigError, match=r"^--b 2 needs about .* GiB of memory .* lower those"):
        mem.check_fits({"--a 1": 10, "--b 2": 21}, total_bytes=30)


def test_the_estimates_grow_with_their_settings():
    assert mem.batch_table_bytes(2, 15, 16) == 2 * (16 + 1) * 4
    assert mem.activation_bytes(10, 4, 8) == 4 * 10 * (32 + 24)
    assert mem.logits_bytes(3, 100) == 4 * 3 * 3 * 100
    assert mem.kv_block_bytes(16, 2, 4, 8, 2) == 2 * 16 * 2 * 4 * 8 * 2


@pytest.mark.parametrize("kwargs, flag", [
    (dict(max_num_seqs=10 ** 9, max_num_batched_tokens=10 ** 9), "--max-num-seqs 1000000000"),
    (dict(max_num_batched_tokens=10 ** 10), "--max-num-batched-tokens 10000000000"),
    (dict(num_gpu_blocks_override=10 ** 12), "--num-gpu-blocks-override 1000000000000"),
])
def test_sizes_past_the_machine_are_refused_by_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=f"^{flag}.*more than this machine's"):
        EngineArgs(model=str(STORIES_DIR), device="cpu", **kwargs).create_kiln_config()


def test_defaults_pass_and_a_seed_torch_cannot_take_is_refused():
    EngineArgs(model=str(STORIES_DIR), device="cpu").create_kiln_config()
    for seed in (2 ** 64, -2 ** 63 - 1):
        with pytest.raises(ConfigError, match=r"seed \(--seed\) must be an integer in"):
            EngineArgs(model=str(STORIES_DIR), device="cpu", seed=seed).create_kiln_config()


def test_no_seed_is_a_fresh_random_one_as_in_vllm():
    """LLM(seed=None), vLLM's signature, was refused ('seed must be int')."""
    seeds = {EngineArgs(model=str(STORIES_DIR), device="cpu", seed=None)
             .create_kiln_config().model_config.seed for _ in range(2)}
    assert len(seeds) == 2 and all(0 <= s < 2 ** 63 for s in seeds)


def test_data_parallel_replicas_each_need_their_buffers():
    """-dp N runs N cores, each with the buffers one needs: a size one fits and N do not is
    refused, naming the replicas."""
    from kiln.platforms import for_device

    total = for_device("cpu").mem_get_info()[1]
    tokens = 1024
    while mem.activation_bytes(tokens, 64, 172) < total / 16:  # stories260K's sizes
        tokens *= 2
    # one replica's buffers fit in the machine; a thousand replicas' do not
    EngineArgs(model=str(STORIES_DIR), device="cpu",
               max_num_batched_tokens=tokens).create_kiln_config()
    with pytest.raises(ConfigError, match=r"x --data-parallel-size 1000 needs about"):
        EngineArgs(model=str(STORIES_DIR), device="cpu", max_num_batched_tokens=tokens,
                   data_parallel_size=1000).create_kiln_config()
