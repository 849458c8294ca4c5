"""vLLM's command lines carry over: its dotted -O form, repeated -O flags adding up, and the
flags that have one meaning here (taken at that meaning, refused with a reason otherwise)."""
import re

import pytest

from kiln.config.compilation_config import cli_fields, merged_fields
from kiln.engine.arg_utils import EngineArgs
from kiln.entrypoints.cli.main import build_parser, dotted_flags_as_O, underscored_flags_dashed
from kiln.entrypoints.cli.serve import settings_from_args


def test_dotted_compilation_flags():
    assert cli_fields(".mode=3") == {"mode": 3}
    assert cli_fields(".cudagraph_mode=NONE") == {"cudagraph_mode": "NONE"}
    assert cli_fields(".pass_config.eliminate_noops=false") == {
        "pass_config": {"eliminate_noops": False}}
    with pytest.raises(ValueError, match=r"-O\.FIELD=VALUE"):
        cli_fields(".mode")
    assert dotted_flags_as_O(["serve", "--compilation-config.mode", "0", "-O.compile_sizes",
                              "[1, 8]", "--compilation-config.backend=eager", "-O3"]) == [
        "serve", "-O.mode=0", "-O.compile_sizes=[1, 8]", "-O.backend=eager",
        "--optimization-level=3"]


def test_repeated_flags_add_up_inside_dict_fields():
    assert merged_fields({"pass_config": {"a": False}, "mode": 3},
                         {"pass_config": {"b": False}, "mode": 0}) == {
        "pass_config": {"a": False, "b": False}, "mode": 0}
    args = build_parser().parse_args(dotted_flags_as_O([
        "serve", "-O.pass_config.eliminate_noops=false", "-O.pass_config.fuse_act_quant=false",
        "--compilation-config.mode", "0"]))
    assert args.compilation_config == {"mode": 0, "pass_config": {
        "eliminate_noops": False, "fuse_act_quant": False}}


def test_vllm_flags_with_one_meaning_here_are_taken():
    args = build_parser().parse_args([
        "serve", "--trust-remote-code", "--disable-log-requests", "--disable-log-stats",
        "--enable-chunked-prefill", "--kv-cache-dtype", "auto", "--swap-space", "8",
        "--tokenizer-mode", "auto"])
    engine_args = EngineArgs.from_cli_args(args)
    engine_args._check_vllm_only_defaults()
    assert engine_args.trust_remote_code and engine_args.enable_chunked_prefill
    assert settings_from_args(args).stats_log_interval is None
    assert settings_from_args(build_parser().parse_args(["serve"])).stats_log_interval == 5.0



@pytest.mark.parametrize("flag, field", [("--enforce-eager", "enforce_eager"),
                                         ("--trust-remote-code", "trust_remote_code"),
                                         ("--skip-tokenizer-init", "skip_tokenizer_init")])
def test_boolean_engine_flags_take_vllms_no_form(flag, field):
    """vLLM makes every boolean engine field a BooleanOptionalAction: `vllm serve M
    --no-enforce-eager` runs; here it was an unrecognized argument (helper-106)."""
    parser = build_parser()
    for argv, _ in _engine_commands(parser):
        on = EngineArgs.from_cli_args(parser.parse_args([*argv, flag]))
        off = EngineArgs.from_cli_args(parser.parse_args([*argv, flag, "--no-" + flag[2:]]))
        assert (getattr(on, field), getattr(off, field)) == (True, False), argv


@pytest.mark.parametrize("command", [["bench", "throughput"], ["generate", "hi"], ["chat"],
                                     ["compile"]])
def test_disable_log_requests_is_taken_wherever_engine_flags_are(command):
    """vLLM's --disable-log-requests (its AsyncEngineArgs: `vllm serve`, `vllm bench
    throughput`) was serve's alone: elsewhere an unknown flag, with a hint to use
    --enable-log-requests, which is refused (helper-80)."""
    args = build_parser().parse_args([*command, "--disable-log-requests"])
    EngineArgs.from_cli_args(args)._check_vllm_only_defaults()

@pytest.mark.parametrize("kwargs, message", [
    (dict(kv_cache_dtype="int8"), "kv_cache_dtype .* must be one of auto, fp8, fp8_e4m3"),
    (dict(tokenizer_mode="mistral"), "fast tokenizer"),
    (dict(swap_space=-1.0), "swap_space must be >= 0"),
])
def test_other_values_are_refused_before_loading_anything(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model="/nowhere", **kwargs).create_kiln_config()


def test_cli_errors_name_the_flag_beside_the_field():
    from kiln.entrypoints.cli.main import with_flag

    parser = build_parser()
    assert with_flag("max_num_seqs must be >= 1, got 0", parser) == \
        "max_num_seqs (--max-num-seqs) must be >= 1, got 0"
    assert with_flag("top_p must be in (0, 1], got 0.0", parser).startswith("top_p (--top-p)")

    for unchanged in ("kv_cache_memory (--kv-cache-memory) must be > 0",  # says it already
                      "prompt 0: too long", "engine died"):
        assert with_flag(unchanged, parser) == unchanged


# The vLLM flags a tester's scripts carried over, each refused by name with its reason (it was
# argparse's top-level "kiln: error: unrecognized arguments" with no word on why).
TESTER_FLAGS = [
    "--max-num-partial-prefills", "--override-generation-config", "--response-role",
    "--limit-mm-per-prompt",
    "--data-parallel-address", "-dpa", "--data-parallel-rpc-port", "--data-parallel-start-rank",
    "--data-parallel-rank", "--data-parallel-hybrid-lb", "-dph", "--data-parallel-external-lb",
    "--data-parallel-multi-port-external-lb", "--max-seq-len-to-capture",
    "--disable-custom-all-reduce", "--enable-log-requests", "--chat-template-content-format",
    "--async-scheduling",
    "--cpu-offload-gb", "--model-impl", "--api-server-count",
    "--rope-scaling", "--rope-theta", "--kv-cache-memory-bytes", "--logprobs-mode",
    "--enable-expert-parallel"]


def _engine_commands(parser=None, prefix=()):
    """[(argv prefix, subparser)] of every command that takes engine flags."""
    import argparse

    parser = parser or build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if "--model" in sub._option_string_actions:
                    yield (*prefix, name), sub
                yield from _engine_commands(sub, (*prefix, name))


def test_every_vllm_flag_in_the_table_is_refused_by_every_engine_command():
    from kiln.engine.vllm_flags import BY_FLAG, VllmOnlyFlagError

    assert set(TESTER_FLAGS) <= set(BY_FLAG)
    commands = dict(_engine_commands())
    assert {("serve",), ("generate",), ("chat",), ("bench", "latency"),
            ("bench", "serve")} <= set(commands)
    parser = build_parser()
    for argv in commands:
        for flag, entry in BY_FLAG.items():
            value = [] if not entry.takes_value else ["x-value"]
            if entry.accepted_alone:
                continue
            if entry.any_value:  # sizes a refused feature: any value is moot
                parser.parse_args([*argv, flag, "16"])
                continue
            with pytest.raises(VllmOnlyFlagError) as e:
                parser.parse_args([*argv, flag, *value])
            message = str(e.value)
            assert message.startswith(f"{flag} is vLLM's flag for ") and "\n" not in message


def test_vllm_flag_refusals_say_why_and_what_instead():
    from kiln.engine.vllm_flags import VllmOnlyFlagError

    parser = build_parser()
    for argv, words in ((["serve", "--limit-mm-per-prompt", "{}"], "text-only"),
                        (["generate", "--rope-scaling", "{}"], "--hf-overrides '{\"rope_scaling"),
                        (["generate", "--rope-theta", "1e6"], "--hf-overrides '{\"rope_theta"),
                        (["serve", "--kv-cache-memory-bytes", "4G"], "--kv-cache-memory 4)"),
                        (["serve", "--override-generation-config", "{}"],
                         "--generation-config DIR"),
                        (["serve", "-dpa", "10.0.0.1"], "all run on this machine (-dp N)"),
                        (["serve", "-dph"], "balances its replicas itself"),
                        (["serve", "-dpr", "1"], "only -dpr 0 is taken"),
                        (["serve", "--logprobs-mode", "processed_logprobs"],
                         "always the model's raw log-probabilities")):
        with pytest.raises(VllmOnlyFlagError, match=re.escape(words)):
            parser.parse_args(argv)


def test_vllm_flags_at_kilns_one_meaning_are_taken():
    args = build_parser().parse_args([
        "serve", "-dp", "1", "--scheduling-policy",
        "fcfs", "--disable-custom-all-reduce", "--response-role",
        "assistant", "--chat-template-content-format", "string", "--api-server-count", "1",
        "--enable-server-load-tracking", "--logprobs-mode", "raw_logprobs"])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args == EngineArgs()


def test_disable_sliding_window_is_an_engine_flag():
    """Kiln's attention has sliding windows now: vLLM's flag asks for full attention capped at
    the window (ModelConfig.disable_sliding_window), no longer a no-op."""
    args = build_parser().parse_args(["serve", "--disable-sliding-window"])
    assert EngineArgs.from_cli_args(args) == EngineArgs(disable_sliding_window=True)
    assert EngineArgs(disable_sliding_window=True).to_cli_args() == ["--disable-sliding-window"]


def test_prefix_caching_hash_algo_sha256_is_taken_others_refused():
    """vLLM's --prefix-caching-hash-algo was an unrecognized argument; Kiln's block hash is
    SHA-256, vLLM's default, so that value is taken and the others refused with why."""
    from kiln.engine.vllm_flags import VllmOnlyFlagError, check_vllm_only_kwargs

    args = build_parser().parse_args(["serve", "--prefix-caching-hash-algo", "sha256"])
    assert EngineArgs.from_cli_args(args) == EngineArgs()
    with pytest.raises(VllmOnlyFlagError, match=r"--prefix-caching-hash-algo is vLLM's flag "
                       r"for choosing the hash of prefix-cache blocks; Kiln hashes .*SHA-256"):
        build_parser().parse_args(["serve", "--prefix-caching-hash-algo", "xxhash"])
    assert check_vllm_only_kwargs({"prefix_caching_hash_algo": "sha256"}) == {}
    with pytest.raises(VllmOnlyFlagError, match="only prefix_caching_hash_algo=sha256"):
        check_vllm_only_kwargs({"prefix_caching_hash_algo": "builtin"})


def test_vllm_flag_refusal_is_one_line_exit_2():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "kiln.entrypoints.cli.main", "serve",
                        "--limit-mm-per-prompt"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [
        "error: --limit-mm-per-prompt is vLLM's flag for multimodal inputs per prompt; Kiln "
        "serves text-only models"]


def test_llm_refuses_vllm_only_arguments_with_the_same_reason():
    from kiln.entrypoints.llm import LLM

    with pytest.raises(ValueError) as e:
        LLM(model="/nowhere", limit_mm_per_prompt={"image": 1})
    assert str(e.value).startswith("limit_mm_per_prompt={'image': 1} is vLLM's argument for "
                                   "multimodal inputs per prompt")
    with pytest.raises(ValueError, match=r"rope_theta=1000000 is vLLM's argument .*hf-overrides"):
        LLM(model="/nowhere", rope_theta=1000000)
    with pytest.raises(ValueError, match="data_parallel_address='10.0.0.1' is vLLM's argument "
                       "for the head node of a multi-node data-parallel deployment"):
        LLM(model="/nowhere", data_parallel_address="10.0.0.1")
    with pytest.raises(ValueError, match="data_parallel_hybrid_lb=True is vLLM's argument .*"
                       "balances its replicas itself"):
        LLM(model="/nowhere", data_parallel_hybrid_lb=True)
    # vLLM's defaults ask for nothing: taken, and the next error is the missing model's
    with pytest.raises(FileNotFoundError, match="/nowhere"):
        LLM(model="/nowhere", enable_lora=False, hf_overrides={}, data_parallel_size=1,
            data_parallel_hybrid_lb=False)


def test_unknown_flags_are_reported_by_the_subcommand(capsys):
    from kiln.entrypoints.cli.main import parse_args

    for argv, prog, hint in ((["serve", "--no-such-flag"], "kiln serve", ""),
                             (["bench", "throughput", "--num-promts", "3"],
                              "kiln bench throughput", " (did you mean --num-prompts?)"),
                             (["generate", "hi", "--enable-lorra"], "kiln generate",
                              " (did you mean --enable-lora?)"),
                             # a prefix is not the flag: --prompt was taken as --prompt-logprobs
                             (["generate", "hi", "--prompt", "x"], "kiln generate", "")):
        with pytest.raises(SystemExit) as e:
            parse_args(build_parser(), argv)
        err = capsys.readouterr().err
        assert e.value.code == 2
        assert err.startswith(f"usage: {prog} "), err
        flag = " ".join(argv[2 if argv[0] == "bench" else 1:]).removeprefix("hi ")
        assert err.endswith(f"{prog}: error: unrecognized arguments: {flag}{hint}\n"), err


@pytest.mark.parametrize("argv, message", [
    (["-O", "-1"], "the compilation mode must be 0, 1, 2 or 3, got -1"),
    (["-O", "3.5"], "the compilation mode must be 0, 1, 2 or 3, got 3.5"),
    (["-O", "7"], "the compilation mode must be 0, 1, 2 or 3, got 7"),
    (["-O", '{"level": 7}'], "compilation_config.level (vLLM's deprecated name for mode) "
                             "must be 0, 1, 2 or 3; got 7"),
    (["--max-model-len", "1.5K"], "a binary suffix (K) takes a whole number; 1.5k is decimal"),
    (["--max-model-len", "lots"], "give an integer"),
])
def test_compilation_and_length_flags_say_what_they_take(capsys, argv, message):
    # -O -1 said "JSON must be an object, got -1"; -O '{"level": 3}' listed the known fields
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["generate", "hi", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_vllms_deprecated_level_is_taken_as_mode():
    """vLLM still takes -O '{"level": N}' / -O.level=N (deprecated for mode): refused here."""
    for argv, mode in ((["-O", '{"level": 0}'], 0), (["-O.level=2"], 2),
                       (["-O3", "-O.level=0"], 0), (["-O", '{"level": 0, "mode": 3}'], 3)):
        args = build_parser().parse_args(["serve", *argv])
        assert args.compilation_config == {"mode": mode}, argv


def test_max_model_len_takes_vllms_human_readable_numbers():
    # vLLM's rule: a lowercase suffix is decimal, an uppercase one binary
    for text, value in (("4096", 4096), ("1k", 1000), ("1K", 1024), ("25.6k", 25600),
                        ("2m", 2_000_000), ("2M", 2 << 20), ("32K", 32768)):
        args = build_parser().parse_args(["serve", "--max-model-len", text])
        assert args.max_model_len == value, text


def test_bench_latency_compare_errors_name_compare():
    from kiln.entrypoints.cli import bench_latency

    for item, message in (("7", "--compare 7: the compilation mode must be 0, 1, 2 or 3"),
                          ('{"mode": 9}', '--compare {"mode": 9}: compilation_config.mode'),
                          ('{"level": 9}', "--compare {\"level\": 9}: compilation_config.level")):
        args = build_parser().parse_args(["bench", "latency", "--model", "/nowhere",
                                          "--compare", "0", item])
        with pytest.raises(ValueError, match=re.escape(message)):
            bench_latency.run(args)


@pytest.mark.parametrize("bench", ["throughput", "latency", "serve", "startup", "compile"])
def test_vllm_bench_dataset_and_result_file_flags_say_what_kiln_does_instead(bench):
    """`vllm bench`'s --dataset-name, --save-result, --output-json ... were argparse's
    "unrecognized arguments" (helper-60)."""
    from kiln.engine.vllm_flags import VLLM_BENCH_FLAGS, VllmOnlyFlagError

    parser = build_parser()
    for entry in VLLM_BENCH_FLAGS:
        flag = entry.flags[0]
        with pytest.raises(VllmOnlyFlagError, match=rf"^{flag} is vLLM's flag for .*; Kiln"):
            parser.parse_args(["bench", bench, flag, *(["x-value"] if entry.takes_value else [])])
    parser.parse_args(["bench", bench, "--dataset-name", "random", "--random-range-ratio", "0"])


def test_bench_serve_takes_vllms_random_lengths_and_points_seed_at_prompt_seed():
    from kiln.entrypoints.cli.bench_serve import run

    args = build_parser().parse_args(["bench", "serve", "--random-input-len", "7",
                                      "--random-output-len", "5"])
    assert (args.input_len, args.output_len) == (7, 5)
    args = build_parser().parse_args(["bench", "serve", "--base-url", "http://127.0.0.1:1",
                                      "--seed", "3"])
    with pytest.raises(ValueError, match=r"--seed: .*is --prompt-seed here"):
        run(args)


def test_dash_O_digits_are_vllms_optimization_levels():
    """vLLM 0.12 made -O N its optimization level (-O1: piecewise compile, fast fusions); Kiln
    read -O1 as mode 1, stock torch.compile with guards and no disk cache (helper-58)."""
    parser = build_parser()

    def mode(*argv):
        args = parser.parse_args(dotted_flags_as_O(["serve", *argv]))
        return int(EngineArgs.from_cli_args(args).compilation().mode)

    assert [mode(f"-O{n}") for n in range(4)] == [0, 3, 3, 3]
    assert mode("-O", "1") == mode("--optimization-level", "2") == mode("-O=1") == 3
    assert mode("--optimization-level=0") == 0
    assert mode("--compilation-config", "1") == mode("-O.mode=1") == 1
    assert mode("-O1", "-O.mode=2") == 2
    with pytest.raises(ValueError, match=r"--optimization-level takes 0, 1, 2 or 3"):
        dotted_flags_as_O(["serve", "--optimization-level", "4"])


def test_a_mode_named_wins_over_the_optimization_level_in_any_order():
    """vLLM: "defaults set by optimization levels are purely defaults; explicit user settings
    will not be overwritten". -O.mode=1 -O3 ran mode 3 (the later flag won), and -O=1 was mode 1
    (argparse read "1" as -O's value, the mode) where -O1 is level 1."""
    parser = build_parser()

    def resolved(*argv):
        args = EngineArgs.from_cli_args(parser.parse_args(dotted_flags_as_O(["serve", *argv])))
        return int(args.compilation().mode)

    assert resolved("-O.mode=1", "-O3") == resolved("-O3", "-O.mode=1") == 1
    assert resolved("--compilation-config", '{"mode": 2}', "-O1") == 2
    assert resolved("--compilation-config", "3", "-O0") == 3
    assert resolved("--compilation-config", '{"compile_sizes": [4]}', "-O0") == 0
    assert resolved("-O=1") == 3
    assert int(EngineArgs(optimization_level=0).compilation().mode) == 0  # LLM(...) takes it
    assert EngineArgs(optimization_level=2, compilation_config=1).compilation().mode == 1
    for bad in (5, True):  # True == 1, but no level
        with pytest.raises(ValueError, match=r"optimization_level must be 0, 1, 2 or 3"):
            EngineArgs(optimization_level=bad).compilation()
    assert EngineArgs(optimization_level=0).to_cli_args() == ["--optimization-level", "0"]


def test_bench_throughput_takes_vllms_random_lengths():
    """`vllm bench throughput --dataset-name random --random-input-len N` was argparse's
    "unrecognized arguments" here while bench serve took it (helper-63)."""
    args = build_parser().parse_args(["bench", "throughput", "--dataset-name", "random",
                                      "--random-input-len", "7", "--random-output-len", "5"])
    assert (args.input_len, args.output_len) == (7, 5)


def test_llm_logprobs_mode_raw_is_taken_and_others_refused():
    # A vLLM script's LLM(logprobs_mode="raw_logprobs") asks for what Kiln always returns; it
    # was refused as an unknown argument, and the processed modes with no word on why.
    from kiln.engine.vllm_flags import VllmOnlyFlagError, check_vllm_only_kwargs

    assert check_vllm_only_kwargs({"logprobs_mode": "raw_logprobs", "seed": 1}) == {"seed": 1}
    with pytest.raises(VllmOnlyFlagError, match="raw log-probabilities"):
        check_vllm_only_kwargs({"logprobs_mode": "processed_logprobs"})


def test_flags_written_with_underscores_are_vllms_dashed_flags():
    """vLLM's FlexibleArgumentParser takes --max_model_len for --max-model-len; here each was an
    unrecognized argument, and `serve --max_model_len 64` even took 64 as the model (helper-106)."""
    argv = ["serve", "m", "--max_model_len=64", "--tensor_parallel_size", "1",
            "--no_enable_prefix_caching", "--compilation_config.pass_config.fuse_x=true",
            "--stop_me", "--", "--keep_this"]
    assert underscored_flags_dashed(argv) == [
        "serve", "m", "--max-model-len=64", "--tensor-parallel-size", "1",
        "--no-enable-prefix-caching", "--compilation-config.pass_config.fuse_x=true",
        "--stop-me", "--", "--keep_this"]
    args = build_parser().parse_args(dotted_flags_as_O(underscored_flags_dashed([
        "bench", "throughput", "--num_prompts", "3", "--max_model_len", "64",
        "--no_enable_prefix_caching", "--compilation_config.mode=0"])))
    assert (args.num_prompts, args.max_model_len, args.enable_prefix_caching,
            args.compilation_config) == (3, 64, False, {"mode": 0})


def test_vllm_bench_latency_flags_are_taken_or_refused_with_what_to_give():
    """`vllm bench latency --batch-size 8 --output-len 128 --num-iters 3`: --batch-size was
    unknown, and --output-len's hint was "did you mean --output-json?" (helper-106)."""
    from kiln.engine.vllm_flags import VllmOnlyFlagError

    parser = build_parser()
    args = parser.parse_args(["bench", "latency", "--batch-size", "8", "--input-len", "32"])
    assert (args.batch_sizes, args.input_len) == ([8], 32)
    for flag in ("--output-len", "--num-iters", "--num-iters-warmup"):
        with pytest.raises(VllmOnlyFlagError, match=f"^{flag} is vLLM's flag for .*--num-steps"):
            parser.parse_args(["bench", "latency", flag, "3"])
    with pytest.raises(VllmOnlyFlagError, match="--batch-sizes sets how many"):
        parser.parse_args(["bench", "latency", "--n", "2"])


def test_vllms_disable_uvicorn_access_log_is_disable_access_log():
    """`vllm serve M --disable-uvicorn-access-log` (vLLM's docs' flag) was an unrecognized
    argument here; it is Kiln's --disable-access-log."""
    assert settings_from_args(build_parser().parse_args(["serve"])).access_log
    args = build_parser().parse_args(["serve", "--disable-uvicorn-access-log"])
    assert not settings_from_args(args).access_log


def test_vllm_deployment_flags_say_why_not_unrecognized():
    """helper-124's migrated `vllm serve` scripts: these were bare "unrecognized arguments"."""
    from kiln.engine.vllm_flags import VllmOnlyFlagError

    parser = build_parser()
    for argv, words in ((["--hf-token", "t"], "HF_TOKEN"), (["--uds", "/tmp/s"], "TCP"),
                        (["--enable-log-outputs"], "never logs them"),
                        (["--guided-decoding-backend", "outlines"], "xgrammar"),
                        (["--otlp-traces-endpoint", "x"], "/metrics"),
                        (["--calculate-kv-scales"], "keeps scales of 1.0")):
        with pytest.raises(VllmOnlyFlagError, match=re.escape(words)):
            parser.parse_args(["serve", *argv])
    args = parser.parse_args(["serve", "--guided-decoding-backend", "xgrammar",
                              "--long-prefill-token-threshold", "0"])
    assert EngineArgs.from_cli_args(args) == EngineArgs()
