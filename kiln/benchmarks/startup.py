"""Start-up benchmark: `kiln generate "Hi" --max-tokens 8` as a fresh process, phase by phase.

Each run is its own interpreter (imports count) that starts the core's first, as the `kiln`
command does; the first run may compile, later ones are warm.
Phases: interpreter and imports, config, tokenizer, the core (its process start, model load,
KV cache sizing, compile / warm-up), the wait for it, the generation, and shutdown.
"""
import json
import sys
import time


def measure(launched_at: float, engine_kwargs: dict, prompt: str, max_tokens: int) -> dict:
    """In the child: seconds per phase, from `launched_at` (the parent's time.monotonic())."""
    entered = time.monotonic()
    from kiln import envs

    if envs.enable_multiprocessing():  # as the `kiln` command does before its imports
        from kiln.engine import core_interpreter

        core_interpreter.prestart()
    from kiln.entrypoints.llm import LLM
    from kiln.sampling_params import SamplingParams

    imported = time.monotonic()
    llm = LLM(**engine_kwargs)
    built = time.monotonic()
    (out,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens),
                          use_tqdm=False)
    generated = time.monotonic()
    engine = llm.llm_engine
    front, core = dict(engine.startup_timings), dict(engine.engine_core.startup_timings)
    llm.shutdown()
    done = time.monotonic()
    return {"interpreter_s": entered - launched_at, "imports_s": imported - entered,
            "llm_s": built - imported, "front": front, "core": core,
            "generate_s": generated - built, "shutdown_s": done - generated,
            "to_first_output_s": generated - launched_at, "tokens": len(out.outputs[0].token_ids)}


def run_startup_bench(engine_kwargs: dict, prompt: str = "Hi", max_tokens: int = 8,
                      runs: int = 2, timeout: float | None = None) -> dict:
    """`runs` fresh processes one after another; the report's phases are the last one's."""
    from kiln.benchmarks.child import run_json_child  # not in the child's measured imports

    results = []
    for _ in range(runs):
        launched = time.monotonic()
        cmd = [sys.executable, "-m", "kiln.benchmarks.startup",
               json.dumps([launched, engine_kwargs, prompt, max_tokens])]
        result, _ = run_json_child(cmd, timeout=timeout)
        result["process_wall_s"] = time.monotonic() - launched
        results.append(result)
    report = {k: _round(v) for k, v in results[-1].items()}
    report["process_wall_s_per_run"] = [round(r["process_wall_s"], 3) for r in results]
    report["engine_kwargs"] = engine_kwargs
    return report


def _round(value):
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, dict):
        return {k: _round(v) for k, v in value.items()}
    return value


if __name__ == "__main__":
    from kiln.entrypoints.cli.main import USAGE_ERROR_EXIT, exit_without_teardown

    launched_at, kwargs, prompt_text, tokens = json.loads(sys.argv[1])
    try:
        report = measure(launched_at, kwargs, prompt_text, tokens)
    except (ValueError, FileNotFoundError) as e:  # the arguments, as the `kiln` command says
        print(f"error: {e}", file=sys.stderr, flush=True)
        exit_without_teardown(USAGE_ERROR_EXIT)
    print(json.dumps(report), flush=True)
    exit_without_teardown(0)  # as the `kiln` command exits
