"""vLLM's command lines carry over: its dotted -O form, repeated -O flags adding up, and the
flags that have one meaning here (taken at that meaning, refused with a reason otherwise)."""
import pytest

from kiln.config.compilation_config import cli_fields, merged_fields
from kiln.engine.arg_utils import EngineArgs
from kiln.entrypoints.cli.main import build_parser, dotted_flags_as_O
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
        "serve", "-O.mode=0", "-O.compile_sizes=[1, 8]", "-O.backend=eager", "-O3"]


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


@pytest.mark.parametrize("kwargs, message", [
    (dict(enable_chunked_prefill=False), "raise --max-num-batched-tokens to --max-model-len"),
    (dict(kv_cache_dtype="fp8"), "the KV cache holds the model's dtype"),
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
