"""`kiln bench throughput`'s counts and lengths are checked before an engine is built: with
the default model and mode 3, building one is a compile of minutes."""
import pytest

from kiln.benchmarks.throughput import RunResult, run_throughput
from kiln.engine.arg_utils import EngineArgs

from checkpoints import STORIES_DIR


@pytest.mark.parametrize("num_prompts, input_len", [(0, 8), (-3, 8), (2, 0), (2, -1)])
def test_counts_are_refused_before_an_engine_is_built(monkeypatch, num_prompts, input_len):
    """--num-prompts 0 and --input-len 0 were refused by random_prompts, called once the engine
    had loaded and compiled (helper-106)."""
    from kiln.engine import llm_engine

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was built before the flags were checked")

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", no_engine)
    args = EngineArgs(model=str(STORIES_DIR), enforce_eager=True, max_model_len=128)
    with pytest.raises(ValueError, match=r"--num-prompts and --input-len must be >= 1"):
        run_throughput(args, num_prompts, input_len, 4)


def test_figures_carry_vllm_bench_throughputs_names():
    """`vllm bench throughput --output-json` writes requests_per_second, tokens_per_second
    (prompt and output tokens), elapsed_time, num_requests and total_num_tokens; Kiln's report
    had none of them (helper-106)."""
    figures = RunResult(2.0, 4, 32, 16).figures()
    assert figures["requests_per_second"] == figures["requests_per_s"] == 2.0
    assert figures["tokens_per_second"] == figures["total_tokens_per_s"] == 24.0
    assert (figures["elapsed_time"], figures["num_requests"], figures["total_num_tokens"]) == (
        2.0, 4, 48)
    assert RunResult(2.0, 4, 32, 16).figures("hf_")["hf_requests_per_second"] == 2.0


def test_a_pooling_engine_is_refused_naming_the_runner(monkeypatch):
    """A pooling engine's requests end at their prefill with no token: `kiln bench throughput
    --runner pooling` (and latency) loaded the model, then failed with "the engine produced 0
    output tokens" (latency: "prefill did not finish"); say --runner before any engine."""
    from kiln.benchmarks.latency import run_latency
    from kiln.engine import llm_engine

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was built before the runner was checked")

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", no_engine)
    args = EngineArgs(model=str(STORIES_DIR), max_model_len=128, runner="pooling",
                      compilation_config=0)
    with pytest.raises(ValueError, match="bench throughput measures generation.*--runner"):
        run_throughput(args, 2, 8, 4)
    with pytest.raises(ValueError, match="bench latency measures generation.*--runner"):
        run_latency(args, [1], 8, 2, compare=["0"])
