"""`kiln bench throughput`'s counts and lengths are checked before an engine is built: with
the default model and mode 3, building one is a compile of minutes."""
import dataclasses
from types import SimpleNamespace

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


class _FakeEngine:
    """Stands in for LLMEngine: the test is about what each engine is asked to do."""

    def __init__(self, kiln_config, multiprocess=False):
        self.quantization = kiln_config.model_config.quantization
        self.seed = kiln_config.model_config.seed
        self.max_model_len = kiln_config.model_config.max_model_len
        self.tokenizer = None
        self.input_processor = SimpleNamespace(longer_context_fix=lambda: "raise it")

    def shutdown(self, timeout=None):
        pass


@pytest.mark.parametrize("rounds", [1, 2])
def test_both_engines_of_a_comparison_sample_as_vllms_bench(monkeypatch, rounds):
    """vLLM's bench throughput samples at temperature 1.0, top_p 1.0 with ignore_eos; Kiln's
    decoded greedily, so its figures were for another workload. Both engines of a comparison get
    the same params, and the report says which."""
    from kiln.benchmarks import engine_probe, throughput
    from kiln.engine import llm_engine

    asked, seeds = [], []

    def fake_run(engine, prompts, params):
        asked.append((engine.quantization, params, prompts))
        seeds.append(engine.seed)
        n = len(prompts)
        return RunResult(1.0, n, n * len(prompts[0]), n * params.max_tokens)

    monkeypatch.setattr(llm_engine, "LLMEngine", _FakeEngine)
    monkeypatch.setattr(engine_probe, "model_weight_bytes", lambda engine: None)
    monkeypatch.setattr(throughput, "run_kiln", fake_run)
    args = EngineArgs(model=str(STORIES_DIR), enforce_eager=True, max_model_len=128,
                      quantization="int8", seed=7)
    report = run_throughput(args, 2, 8, 4, compare_unquantized=True, rounds=rounds)
    assert [q for q, _, _ in asked] == ["int8", None] * rounds
    for _, params, _ in asked:
        assert (params.temperature, params.top_p, params.ignore_eos, params.max_tokens) == (
            1.0, 1.0, True, 4)
    assert asked[0][2] == asked[1][2]  # the same prompts too
    assert (report["temperature"], report["top_p"], report["ignore_eos"], report["seed"]) == (
        1.0, 1.0, True, 7)
    seeds.clear()
    # seed=None (a random one): both engines sample with the one the report records
    report = run_throughput(dataclasses.replace(args, seed=None), 2, 8, 4,
                            compare_unquantized=True)
    assert seeds == [report["seed"]] * 2
    asked.clear()
    report = run_throughput(args, 2, 8, 4, compare_unquantized=True, temperature=0.0,
                            top_p=0.5)
    assert {(p.temperature, p.top_p) for _, p, _ in asked} == {(0.0, 0.5)}
    assert report["temperature"] == 0.0


def test_bad_sampling_flags_are_refused_before_an_engine_is_built(monkeypatch):
    from kiln.engine import llm_engine

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was built before the flags were checked")

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", no_engine)
    args = EngineArgs(model=str(STORIES_DIR), enforce_eager=True, max_model_len=128)
    with pytest.raises(ValueError, match="temperature"):
        run_throughput(args, 2, 8, 4, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        run_throughput(args, 2, 8, 4, top_p=0.0)


def test_the_cli_defaults_are_vllms():
    import argparse

    from kiln.entrypoints.cli.bench_throughput import register

    sub = argparse.ArgumentParser().add_subparsers()
    register(sub)
    args = sub.choices["bench"].parse_args(["throughput"])
    assert (args.temperature, args.top_p, args.seed) == (1.0, 1.0, 0)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_the_hf_baseline_ignores_the_checkpoints_sampling_defaults(tiny_llama_dir, temperature):
    """HF generate applies a checkpoint's generation_config (repetition_penalty, ...) where
    Kiln's bench requests take none: the baseline then sampled (and worked) otherwise."""
    import torch
    from transformers import AutoModelForCausalLM

    from kiln.benchmarks.throughput import bench_params
    from kiln.benchmarks.throughput_hf import run_hf

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    model.generation_config.update(repetition_penalty=1.5, min_p=0.2, typical_p=0.5,
                                   no_repeat_ngram_size=2)
    seen = []
    processors = model._get_logits_processor

    def spy(*args, **kwargs):
        chosen = processors(*args, **kwargs)
        seen.extend(type(p).__name__ for p in chosen)
        return chosen
    model._get_logits_processor = spy
    run_hf(model, [[5, 6, 7]], bench_params(2, temperature), 1, 0)
    assert seen and not [n for n in seen if n.startswith(("Repetition", "MinP", "Typical",
                                                          "NoRepeat"))], seen
