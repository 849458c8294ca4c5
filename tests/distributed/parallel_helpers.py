"""Helpers for multi-rank engine tests: 2 ranks (gloo on CPU), each bound to one core."""
from kiln import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [300, 301, 302]]
MAX_TOKENS = 8


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def generate_ids(llm: LLM, prompts=PROMPTS, params=None) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params or greedy(),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def make_llm(model_dir, **kw) -> LLM:
    kw.setdefault("compilation_config", 0)
    kw.setdefault("max_model_len", 128)
    return LLM(model=str(model_dir), dtype="float32", **kw)


def shutdown_and_check_ranks_exit(llm: LLM) -> None:
    """Shut the engine down; every rank process must have exited."""
    executor = llm.llm_engine.engine_core.executor
    procs = list(getattr(executor, "procs", []))
    llm.llm_engine.engine_core.shutdown()
    assert procs and all(not p.is_alive() for p in procs), \
        [(p.pid, p.exitcode) for p in procs]
