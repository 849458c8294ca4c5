"""EngineArgs -> KilnConfig mapping and vLLM-named CLI flags."""
import argparse

import pytest

from kiln.config import CompilationConfig, CompilationMode
from kiln.engine.arg_utils import EngineArgs


def parse(*argv) -> EngineArgs:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    return EngineArgs.from_cli_args(parser.parse_args(list(argv)))


def test_defaults_match_dataclass():
    assert parse() == EngineArgs()


def test_flags_map_to_fields():
    a = parse("--model", "m", "--tokenizer", "t", "--dtype", "bfloat16", "--max-model-len", "99",
              "--max-num-seqs", "4", "--max-num-batched-tokens", "128", "--enforce-eager",
              "-tp", "2", "--seed", "3", "--load-format", "dummy", "--block-size", "32",
              "--kv-cache-memory", "0.5", "--no-enable-prefix-caching",
              "--num-gpu-blocks-override", "7", "--gpu-memory-utilization", "0.5")
    assert (a.model, a.tokenizer, a.dtype, a.max_model_len) == ("m", "t", "bfloat16", 99)
    assert (a.max_num_seqs, a.max_num_batched_tokens, a.enforce_eager) == (4, 128, True)
    assert (a.tensor_parallel_size, a.seed, a.load_format, a.block_size) == (2, 3, "dummy", 32)
    assert (a.kv_cache_memory, a.enable_prefix_caching, a.num_gpu_blocks_override) == (0.5, False, 7)
    assert a.gpu_memory_utilization == 0.5
    assert parse("--tensor-parallel-size", "4").tensor_parallel_size == 4


def test_scheduling_policy_flag_reaches_the_scheduler_config_and_round_trips():
    a = parse("--scheduling-policy", "priority")
    assert a.scheduling_policy == "priority"
    assert a.to_cli_args() == ["--scheduling-policy", "priority"]
    assert parse().scheduling_policy == "fcfs"  # vLLM's default
    with pytest.raises(SystemExit):
        parse("--scheduling-policy", "lifo")


@pytest.mark.parametrize("argv,mode", [(["-O3"], 3), (["-O", "0"], 0),
                                       (["-O", '{"mode": 2}'], 2),
                                       (["--compilation-config", '{"mode":1}'], 1)])
def test_compilation_flag(argv, mode):
    assert CompilationConfig.from_cli(parse(*argv).compilation_config).mode == mode


def test_compilation_flags_given_twice_merge():
    args = parse("--compilation-config", '{"compile_sizes": [4], "mode": 2}', "-O3")
    assert args.compilation_config == {"compile_sizes": [4], "mode": 3}
    assert parse("-O3", "-O", '{"compile_sizes": [1]}').compilation_config == {
        "mode": 3, "compile_sizes": [1]}


@pytest.mark.parametrize("value, error", [
    ("fast", "-O/--compilation-config must be a mode number, -O.FIELD=VALUE or a JSON object"),
    ("[1, 2]", "-O/--compilation-config JSON must be an object")])
def test_compilation_flag_that_is_no_mode_or_object_is_a_usage_error(value, error, capsys):
    with pytest.raises(SystemExit) as e:
        parse("-O", value)
    assert e.value.code == 2 and error in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["-1", "auto", "AUTO"])
def test_max_model_len_auto_is_the_models_lowered_to_fit_as_vllm_takes_it(flag, tiny_llama_dir):
    """vLLM's --max-model-len -1 / auto (the model's length, auto-fit to the KV cache) was
    refused ("auto" as no int, -1 as max_model_len < 1); it is what an unset one gets."""
    args = parse("--model", str(tiny_llama_dir), "--max-model-len", flag, "--device", "cpu")
    assert args.max_model_len == -1
    model = args.create_kiln_config().model_config
    assert model.max_model_len == 512 and model.max_model_len_from_model


def test_create_kiln_config(stories_dir):
    args = EngineArgs(model=str(stories_dir), max_model_len=128, max_num_seqs=8,
                      max_num_batched_tokens=256, compilation_config='{"mode": 3, '
                      '"compile_sizes": [1, 4]}', seed=5, block_size=32, kv_cache_memory=0.25,
                      enable_prefix_caching=False, num_gpu_blocks_override=10, device="cpu")
    c = args.create_kiln_config()
    assert c.model_config.max_model_len == 128 and c.scheduler_config.max_model_len == 128
    assert c.model_config.seed == 5 and c.model_config.load_format == "safetensors"
    assert (c.scheduler_config.max_num_seqs, c.scheduler_config.max_num_batched_tokens) == (8, 256)
    assert (c.cache_config.block_size, c.cache_config.kv_cache_memory) == (32, 0.25)
    assert not c.cache_config.enable_prefix_caching and c.cache_config.num_gpu_blocks_override == 10
    assert c.compilation_config.mode == CompilationMode.KILN_COMPILE
    assert c.compilation_config.compile_sizes == [1, 4]
    assert c.device_config.device == "cpu"


def test_enforce_eager_and_shared_compilation_config(stories_dir, kiln_logs):
    shared = CompilationConfig(mode=3)
    c = EngineArgs(model=str(stories_dir), enforce_eager=True,
                   compilation_config=shared).create_kiln_config()
    assert c.compilation_config.mode == CompilationMode.NONE
    # Said, as vLLM says it: -O 3 beside --enforce-eager ran eagerly in silence.
    assert "--enforce-eager overrides compilation mode 3" in kiln_logs.text
    assert shared.mode == CompilationMode.KILN_COMPILE  # the caller's object is untouched
    assert EngineArgs(model=str(stories_dir), compilation_config={"mode": 1}
                      ).create_kiln_config().compilation_config.mode == 1


@pytest.mark.parametrize("kwargs,match", [
    (dict(load_format="pickle"), "load_format"),
    (dict(block_size=12), "block_size"),
    (dict(compilation_config="{bad json"), "compilation-config"),
    (dict(compilation_config={"nope": 1}), "nope"),
    (dict(max_model_len=100000), "--max-model-len"),
    (dict(max_num_seqs=64, max_num_batched_tokens=8), "--max-num-batched-tokens"),
    (dict(max_num_batched_tokens=64, compilation_config={"compile_sizes": [128]}),
     r"compile size 128 exceeds max_num_batched_tokens \(64\).*drop it from "
     r"compilation_config\.compile_sizes or raise --max-num-batched-tokens"),
    (dict(max_model_len="64"), "max_model_len must be int or None"),
    (dict(max_num_seqs=2.5), "max_num_seqs must be int"),
    (dict(enforce_eager="no"), "enforce_eager must be bool"),
    (dict(scheduling_policy="sjf"), "--scheduling-policy must be fcfs or priority"),
])
def test_bad_values_raise_naming_the_field(stories_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=str(stories_dir), **kwargs).create_kiln_config()


def test_compile_sizes_are_not_checked_where_nothing_compiles(stories_dir):
    # vLLM's flags carry over: sizes beside --enforce-eager are unused, not an error.
    EngineArgs(model=str(stories_dir), max_num_batched_tokens=64, enforce_eager=True,
               compilation_config={"compile_sizes": [128]}).create_kiln_config()


def test_missing_model_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        EngineArgs(model=str(tmp_path / "nope")).create_kiln_config()


def test_device_cuda_without_cuda_names_the_flag():
    import torch

    from kiln.config.device_config import DeviceConfig, resolve_device

    assert resolve_device("cuda") == "cuda" and resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("tpu")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="--device cpu"):
        DeviceConfig("cuda")


def test_a_torch_dtype_is_taken_as_vllm_takes_it(stories_dir):
    """LLM(dtype=torch.bfloat16) (vLLM's dtype is a str or a torch.dtype) was refused:
    "dtype must be str, got torch.bfloat16"."""
    import torch

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        c = EngineArgs(model=str(stories_dir), dtype=dtype).create_kiln_config()
        assert c.model_config.torch_dtype == dtype
    with pytest.raises(ValueError, match="dtype must be auto, float32, bfloat16 or float16"):
        EngineArgs(model=str(stories_dir), dtype=torch.float64).create_kiln_config()


def test_a_torch_dtype_crosses_to_a_child_command_by_name():
    """EngineArgs(dtype=torch.float16).to_cli_args() gave `--dtype torch.float16` (the child
    `kiln` command refuses it); dataclasses.replace and == see the name as well."""
    import dataclasses

    import torch

    for dtype, name in ((torch.half, "float16"), (torch.bfloat16, "bfloat16"),
                        (torch.float, "float32")):
        args = EngineArgs(model="m", dtype=dtype)
        assert args.to_cli_args() == ["--model", "m", "--dtype", name]
        assert args == EngineArgs(model="m", dtype=name)
        assert dataclasses.replace(EngineArgs(model="m"), dtype=dtype).dtype == name
        parsed = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(
            args.to_cli_args())
        assert EngineArgs.from_cli_args(parsed) == args
