"""Offline throughput: fixed-length random-token requests through Kiln, and optionally HF generate
or the same engine unquantized (`--compare-unquantized`) as the baseline, in one invocation
(`--rounds N`: the two engines alternate N rounds, for hosts whose speed drifts).

Every run gets the same prompts, dtype and sampling (vLLM's bench throughput's: temperature 1.0,
top_p 1.0, ignore_eos; seeded by --seed) with exactly `output_len` new tokens per request; engine
construction (load, compile, warm-up) is outside the timed region.
"""
import dataclasses
import random
import statistics
import time
from dataclasses import dataclass

from kiln.benchmarks.comm_figures import comm_figures
from kiln.benchmarks.vllm_fields import throughput_fields
from kiln.engine.arg_utils import EngineArgs
from kiln.logger import init_logger
from kiln.model.layers.quantization import ONLINE_METHODS
from kiln.pooling.pooling_inputs import refuse_pooling_bench

logger = init_logger(__name__)


@dataclass
class RunResult:
    elapsed_s: float
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s

    def figures(self, prefix: str = "") -> dict:
        e = self.elapsed_s
        return {f"{prefix}elapsed_s": round(e, 4),
                f"{prefix}requests_per_s": round(self.num_requests / e, 4),
                f"{prefix}output_tokens_per_s": round(self.output_tokens_per_s, 4),
                f"{prefix}total_tokens_per_s":
                    round((self.num_prompt_tokens + self.num_output_tokens) / e, 4),
                # the same figures under `vllm bench throughput --output-json`'s names
                **throughput_fields(e, self.num_requests, self.num_prompt_tokens,
                                    self.num_output_tokens, prefix)}


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int,
                   exclude: set[int] = frozenset()) -> list[list[int]]:
    """Seeded random token ids, avoiding special tokens so no prompt holds an early eos."""
    check_counts(num_prompts, input_len)
    choices = [t for t in range(vocab_size) if t not in exclude]
    rng = random.Random(seed)
    return [[rng.choice(choices) for _ in range(input_len)] for _ in range(num_prompts)]


def check_counts(num_prompts: int, input_len: int) -> None:
    if num_prompts < 1 or input_len < 1:
        raise ValueError(f"--num-prompts and --input-len must be >= 1, got {num_prompts} and "
                         f"{input_len}")


def check_lengths(input_len: int, output_len: int, max_model_len: int,
                  longer: str = "raise --max-model-len") -> None:
    """`longer`: what lets a request run longer (InputProcessor.longer_context_fix, once an
    engine is built: its KV cache may cap max_model_len)."""
    if output_len < 1:
        raise ValueError(f"--output-len must be >= 1, got {output_len}")
    if input_len + output_len > max_model_len:
        raise ValueError(f"--input-len {input_len} + --output-len {output_len} exceeds "
                         f"max_model_len {max_model_len}; shorten them or {longer}")


def bench_params(output_len: int, temperature: float = 1.0, top_p: float = 1.0):
    """Every engine's request: vLLM's bench throughput samples at temperature 1.0 and top_p 1.0
    with ignore_eos; SamplingParams refuses a bad --temperature / --top-p before any engine."""
    from kiln.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(temperature=temperature, top_p=top_p, ignore_eos=True,
                          max_tokens=output_len, min_tokens=output_len,
                          output_kind=RequestOutputKind.FINAL_ONLY)


def run_kiln(engine, prompts: list[list[int]], params) -> RunResult:
    """`params`: bench_params(...) (the engine's generator, seeded by --seed, draws the
    samples: the same seed gives the same run)."""
    output_len = params.max_tokens
    processed = [engine.process_inputs({"prompt_token_ids": p}, params) for p in prompts]
    num_out = 0
    start = time.perf_counter()
    for i, item in enumerate(processed):
        engine.add_processed_request(f"bench-{i}", item)
    while engine.has_unfinished_requests():
        for out in engine.step():
            num_out += sum(len(c.token_ids) for c in out.outputs)
    elapsed = time.perf_counter() - start
    if num_out != len(prompts) * output_len:  # a figure for other work than asked is no figure
        raise RuntimeError(f"the engine produced {num_out} output tokens, not {len(prompts)} "
                           f"x {output_len}")
    return RunResult(elapsed, len(prompts), sum(map(len, prompts)), num_out)


def _timed_engine_run(kiln_config, prompts_for, params, multiprocess: bool = False):
    """Build an engine, time one run over prompts_for(engine): (result, comm figures, weight
    bytes, prompts, tokenizer). In this process by default (as the latency benchmark): the
    figures read the executor and the model. `multiprocess`: the core in its own process, as
    `LLM` runs it (no communication or weight figures then)."""
    from kiln.benchmarks.engine_probe import model_weight_bytes
    from kiln.engine.llm_engine import LLMEngine

    engine = LLMEngine(kiln_config, multiprocess=multiprocess)
    executor = getattr(getattr(engine, "engine_core", None), "executor", None)
    try:
        prompts = prompts_for(engine)  # may refuse (a prompt past max_model_len): shut down too
        if executor is not None:
            executor.reset_comm_stats()  # warm-up's collectives are not the run's
        weight_bytes = model_weight_bytes(engine)  # None when the model lives in other ranks
        result = run_kiln(engine, prompts, params)
        comm = comm_figures(executor.comm_stats() if executor is not None else None)
    finally:
        engine.shutdown()
    return result, comm, weight_bytes, prompts, engine.tokenizer


def alternated_rounds(engines: list, prompts_for_round, params,
                      rounds: int) -> list[list[RunResult]]:
    """Each engine's results over `rounds` rounds, the engines taking turns within a round on
    that round's prompts (fresh ones each round: the prefix cache must not serve a later round),
    so that a host whose speed drifts slows every engine alike."""
    results: list[list[RunResult]] = [[] for _ in engines]
    for r in range(rounds):
        prompts = prompts_for_round(r)
        for engine, mine in zip(engines, results):
            mine.append(run_kiln(engine, prompts, params))
    return results


def _compare_rounds(quant_config, base_config, seeded_prompts, params, rounds: int,
                    multiprocess: bool) -> dict:
    """Both engines built up front, then alternated rounds (alternated_rounds): the report's
    per-round figures and the median round's (the lower middle one of an even count)."""
    from kiln.benchmarks.engine_probe import model_weight_bytes
    from kiln.engine.llm_engine import LLMEngine

    engines = []
    try:
        for config in (quant_config, base_config):
            engines.append(LLMEngine(config, multiprocess=multiprocess))
        quant, base = alternated_rounds(engines, lambda r: seeded_prompts(engines[0], r),
                                        params, rounds)
        weights = [model_weight_bytes(e) for e in engines]
    finally:
        for engine in engines:
            engine.shutdown()
    speedups = [q.output_tokens_per_s / b.output_tokens_per_s for q, b in zip(quant, base)]
    # a round's own ratio (the lower middle one of an even count), so it matches its figures
    best = speedups.index(statistics.median_low(speedups))
    report = {**quant[best].figures(), **base[best].figures("unquantized_"),
              "num_output_tokens": quant[best].num_output_tokens, "rounds": rounds,
              "round_output_tokens_per_s": [round(q.output_tokens_per_s, 2) for q in quant],
              "round_unquantized_output_tokens_per_s": [
                  round(b.output_tokens_per_s, 2) for b in base],
              "round_speedups": [round(x, 4) for x in speedups],
              "speedup_vs_unquantized": speedups[best],
              "model_weight_bytes": weights[0], "unquantized_model_weight_bytes": weights[1]}
    if weights[0] and weights[1]:
        report["weight_bytes_vs_unquantized"] = weights[0] / weights[1]
    return report


def run_throughput(engine_args: EngineArgs, num_prompts: int, input_len: int, output_len: int,
                   backend: str = "kiln", compare_unquantized: bool = False,
                   multiprocess: bool = False, rounds: int = 1, temperature: float = 1.0,
                   top_p: float = 1.0) -> dict:
    """Benchmark; returns the one-line JSON report as a dict. temperature / top_p: every
    engine's sampling (vLLM's defaults; 0: greedy). compare_unquantized: then the
    same prompts through the same engine without --quantization (the baseline), and ratios;
    with rounds > 1 both engines alternate that many rounds (the median round reported).
    multiprocess: each engine's core in its own process, as `LLM` runs it."""
    check_counts(num_prompts, input_len)  # said before the model loads and compiles
    params = bench_params(max(output_len, 1), temperature, top_p)
    if backend not in ("kiln", "hf"):
        raise ValueError(f"--backend must be kiln or hf, got {backend!r}")
    if compare_unquantized and engine_args.quantization is None:
        raise ValueError("--compare-unquantized needs --quantization (the run to compare)")
    if compare_unquantized and engine_args.quantization not in ONLINE_METHODS:
        raise ValueError(f"--compare-unquantized runs a float checkpoint quantized on load "
                         f"against itself unquantized; --quantization "
                         f"{engine_args.quantization} has no float weights to compare: give "
                         f"the float checkpoint with --quantization {' / '.join(ONLINE_METHODS)}")
    if rounds < 1 or (rounds > 1 and (not compare_unquantized or backend == "hf")):
        raise ValueError(f"--rounds {rounds}: must be >= 1, and above 1 only with "
                         "--compare-unquantized and the kiln backend (rounds alternate the "
                         "two engines)")
    kiln_config = engine_args.create_kiln_config()
    mc = kiln_config.model_config
    refuse_pooling_bench(mc, "kiln bench throughput")
    check_lengths(input_len, output_len, mc.max_model_len)

    def seeded_prompts(engine, round_index: int = 0):
        # the engine may cap max_model_len to what its KV cache holds
        check_lengths(input_len, output_len, engine.max_model_len,
                      engine.input_processor.longer_context_fix())
        exclude = set(getattr(engine.tokenizer, "all_special_ids", []))
        return random_prompts(num_prompts, input_len, mc.vocab_size,
                              seed + round_index, exclude)

    seed = mc.seed  # --seed: the prompts, the engines' samples, HF's (a random one if None)
    pc = kiln_config.parallel_config
    report = {"backend": backend, "num_prompts": num_prompts, "input_len": input_len,
              "output_len": output_len, "temperature": params.temperature,
              "top_p": params.top_p, "ignore_eos": True, "seed": seed, "model": mc.model,
              "dtype": str(mc.torch_dtype).removeprefix("torch."),
              "quantization": mc.quantization,
              "quantization_rotation": mc.quantization_rotation, "device": kiln_config.device_config.device,
              "compilation_mode": int(kiln_config.compilation_config.mode),
              "max_num_seqs": kiln_config.scheduler_config.max_num_seqs,
              "tensor_parallel_size": pc.tensor_parallel_size,
              "pipeline_parallel_size": pc.pipeline_parallel_size,
              "distributed_executor_backend": pc.distributed_executor_backend,
              "engine_core": "own process" if multiprocess else "in-process"}
    # the baseline samples with the seed reported (seed=None drew a random one just above)
    base_config = dataclasses.replace(
        engine_args, quantization=None, quantization_rotation="none", seed=seed
    ).create_kiln_config() if compare_unquantized else None
    if rounds > 1:
        report.update(_compare_rounds(kiln_config, base_config, seeded_prompts, params, rounds,
                                      multiprocess))
        return report
    result, comm, weight_bytes, prompts, tokenizer = _timed_engine_run(
        kiln_config, seeded_prompts, params, multiprocess)
    report.update(result.figures(), num_output_tokens=result.num_output_tokens,
                  model_weight_bytes=weight_bytes)
    if comm:
        report["communication"] = comm
    if compare_unquantized:
        base, _, base_bytes, _, _ = _timed_engine_run(base_config, lambda engine: prompts,
                                                      params, multiprocess)
        report.update(base.figures("unquantized_"),
                      unquantized_model_weight_bytes=base_bytes,
                      speedup_vs_unquantized=result.output_tokens_per_s
                      / base.output_tokens_per_s)
        if weight_bytes and base_bytes:
            report["weight_bytes_vs_unquantized"] = weight_bytes / base_bytes
    if backend == "hf":
        from kiln.benchmarks.throughput_hf import load_hf_model, run_hf

        model = load_hf_model(kiln_config)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (
            tokenizer.eos_token_id or 0)
        hf = run_hf(model, prompts, params, kiln_config.scheduler_config.max_num_seqs, pad_id,
                    seed)
        report.update(hf.figures("hf_"), hf_num_output_tokens=hf.num_output_tokens,
                      kiln_vs_hf_output_tokens_per_s=(
                          result.output_tokens_per_s / hf.output_tokens_per_s))
    return report
