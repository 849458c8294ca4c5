"""LLMEngine.get_stats() token totals on a tiny real model agree with the server's counters:
a prompt counts once per prefilled sample, and a request aborted before its prefill not at all."""
import pytest

from kiln.engine.arg_utils import EngineArgs
from kiln.engine.llm_engine import LLMEngine
from kiln.sampling_params import SamplingParams

# The engine core in this process: what is tested is the engine, not its process (a core
# process costs an interpreter start per engine; test_core_process.py covers that one).
pytestmark = pytest.mark.usefixtures("inprocess_core")


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    eng = LLMEngine.from_engine_args(EngineArgs(
        model=str(tiny_llama_dir), enforce_eager=True, max_model_len=128, max_num_seqs=4,
        kv_cache_memory=0.02))
    yield eng
    eng.shutdown()


def drain(engine):
    while engine.has_unfinished_requests():
        engine.step()


def test_token_totals_count_prefilled_samples(engine):
    before = engine.get_stats()
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    engine.add_request("n2", prompt, SamplingParams(n=2, max_tokens=3, ignore_eos=True,
                                                    temperature=1.0, seed=1))
    drain(engine)
    mid = engine.get_stats()
    assert mid["prompt_tokens_total"] - before["prompt_tokens_total"] == 2 * 5
    assert mid["generation_tokens_total"] - before["generation_tokens_total"] == 2 * 3
    # Added then aborted before any step: nothing was prefilled or generated.
    engine.add_request("gone", prompt, SamplingParams(max_tokens=3))
    engine.abort_request("gone")
    drain(engine)
    after = engine.get_stats()
    assert after["prompt_tokens_total"] == mid["prompt_tokens_total"]
    assert after["generation_tokens_total"] == mid["generation_tokens_total"]
    assert after["num_running"] == after["num_waiting"] == 0
    assert after["kv_cache_usage"] == 0.0


def test_a_batch_with_several_steps_of_a_sample_counts_its_prompt_once():
    """The core can run ahead of the front end: one batch then holds a sample's first and later
    outputs before the output processor has given it a token. The prompt counted once per such
    output made the test above fail about one run in four. Each core step's tokens stay apart
    (iteration_tokens_total observes one value per core step with outputs, as vLLM's): the
    prompt in the step of its first token; no value for a step without outputs (a partial
    prefill) or with only outputs of a request no longer here (aborted meanwhile); 0 for a
    step that ended a request without a token (the core's abort)."""
    from types import SimpleNamespace

    from kiln.core.outputs import EngineCoreOutput
    from kiln.engine.output_processor import OutputProcessor
    from kiln.sampling_params import RequestOutputKind

    proc = OutputProcessor(None)
    for rid in ("a", "b"):
        proc.add_request(rid, None, [5, 6, 7, 8, 9], [(rid, SamplingParams(max_tokens=9))],
                         RequestOutputKind.DELTA)
    steps = [[EngineCoreOutput(rid, [t]) for rid in ("a", "b")] for t in (1, 2, 3)]
    steps.insert(1, [])
    steps.append([EngineCoreOutput("gone", [4])])
    steps.append([EngineCoreOutput("a", [])])
    fake = SimpleNamespace(num_prompt_tokens=0, num_generation_tokens=0)
    seen = proc.process_outputs([out for outputs in steps for out in outputs]).seen_tokens
    totals = LLMEngine._count_tokens(fake, steps, seen, [0, 0, 1, 1, 0, 1])
    assert fake.num_prompt_tokens == 2 * 5 and fake.num_generation_tokens == 6
    assert [(s.engine, s.tokens) for s in totals] == [(0, 2 * 5 + 2), (1, 2), (1, 2), (1, 0)]
    assert totals[0].by_request == {"a": 5 + 1, "b": 5 + 1}  # the front end drops an abort's
