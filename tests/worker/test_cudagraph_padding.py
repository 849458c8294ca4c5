"""Graph-mode padding on CPU: a forced dispatcher pads decode and mixed steps; the eager model
runs the padded batch (no wrappers on CPU), and tokens must still equal HF's greedy ones."""
import pytest
from schedule_driver import ScheduleDriver
from test_model_runner import BS, make_executor

from kiln.cudagraphs.dispatcher import CudagraphDispatcher
from kiln.sampling_params import SamplingParams

from checkpoints import hf_greedy, random_prompts

NEW = 6


@pytest.fixture(scope="module")
def executor(tiny_llama_dir):
    """One runner for every mode: each test sets its own dispatcher and ends its requests."""
    ex = make_executor(tiny_llama_dir)
    yield ex
    ex.shutdown()


@pytest.fixture(scope="module")
def prompts_and_oracle(tiny_llama_dir):
    prompts = random_prompts(3, [5, 7, 3])
    return prompts, hf_greedy(tiny_llama_dir, prompts, NEW)


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL", "FULL_AND_PIECEWISE"])
def test_padded_steps_match_hf(executor, prompts_and_oracle, mode, monkeypatch):
    runner = executor.worker.model_runner
    monkeypatch.setattr(runner, "cudagraph_dispatcher",
                        CudagraphDispatcher(mode, [1, 2, 4, 8, 16], max_num_seqs=4))
    seen = []
    run = runner._run_model

    def spy(*args):
        seen.append((*runner._cudagraph_step, args[0].shape[0], args[2].num_reqs))
        return run(*args)

    monkeypatch.setattr(runner, "_run_model", spy)
    prompts, expected = prompts_and_oracle
    drv = ScheduleDriver(executor, BS)
    for rid, p in zip("abc", prompts):
        drv.add(rid, p, SamplingParams(temperature=0, max_tokens=NEW))
    drv.step({"a": 5, "b": 7})  # 12 tokens -> 16
    drv.step({"a": 1, "b": 1, "c": 3})  # mixed 5 -> 8
    while any(len(drv.reqs[r].outputs) < NEW for r in list(drv.reqs)):
        plan = {r: 1 for r, q in drv.reqs.items() if len(q.outputs) < NEW}
        for r in [r for r in drv.reqs if r not in plan]:
            drv.finish(r)
        drv.step(plan)  # decode 3 -> 4
    assert [drv.tokens(r) for r in "abc"] == expected
    assert seen[0][2] == 16 and seen[1][2] == 8 and seen[2][2] == 4
    drv.finish_all()
    assert runner.requests == {}
