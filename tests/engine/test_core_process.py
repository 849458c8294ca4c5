"""The engine core in its own process: the wire format, parity with the in-process core, start-up
errors of the same kind. A core that dies, is dropped or is signalled: test_core_process_exit.py."""
import dataclasses
import os
import time
from pathlib import Path

import pytest

from kiln.core.core_messages import decode_params, encode_params, from_wire, input_codec, to_wire
from kiln.core.request import Request
from kiln.engine.core_errors import EngineCoreDeadError
from kiln.entrypoints.llm import LLM
from kiln.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

ENGINE = dict(enforce_eager=True, max_model_len=64, kv_cache_memory=0.01)
PROMPTS = [{"prompt_token_ids": [1, 2, 3, 4]}, {"prompt_token_ids": [9, 8, 7]}]


def test_sampling_params_cross_field_by_field():
    params = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=-3,
                            presence_penalty=0.5, frequency_penalty=-0.5,
                            repetition_penalty=1.2, stop=["x", "yz"], stop_token_ids=[4],
                            ignore_eos=True, max_tokens=9, min_tokens=2, logprobs=3,
                            prompt_logprobs=1, skip_special_tokens=False,
                            include_stop_str_in_output=True, detokenize=True,
                            logit_bias={5: -2.5, 7: 1.0}, allowed_token_ids=[4, 5, 7],
                            bad_words=["ab"], truncate_prompt_tokens=3,
                            structured_outputs=StructuredOutputsParams(
                                json={"type": "object", "properties": {"a": {"type": "integer"}}},
                                reasoning_end="</think>"),
                            output_kind=RequestOutputKind.DELTA)
    params.all_stop_token_ids = {4, 2}  # the engine front adds eos: verify() would reset it
    params.bad_words_token_ids = [[8, 9], [10]]
    encoder, decoder = input_codec()
    request = Request("r", [1, 2], params, arrival_time=12.5, cache_salt="s")
    back = from_wire(decoder.decode(encoder.encode(to_wire(request))))
    assert back.sampling_params == params
    for f in dataclasses.fields(SamplingParams):
        assert type(getattr(back.sampling_params, f.name)) is type(getattr(params, f.name)), \
            f.name
    assert (back.request_id, back.prompt_token_ids, back.arrival_time, back.cache_salt) == (
        "r", [1, 2], 12.5, "s")


def test_a_kiln_error_from_the_core_is_raised_as_its_own_kind():
    from kiln.core.core_messages import CoreFailed
    from kiln.engine.core_errors import rebuild_error
    from kiln.executor.rank_errors import WorkerFailedError

    error = rebuild_error(CoreFailed(error_type="WorkerFailedError", message="rank 1 died",
                                      error_module="kiln.executor.rank_errors"))
    assert type(error) is WorkerFailedError and str(error) == "rank 1 died"
    assert type(rebuild_error(CoreFailed(error_type="ValueError", message="m"))) is ValueError
    # Not a built-in nor Kiln's: the front says the core failed, with the core's message.
    other = rebuild_error(CoreFailed(error_type="Boom", message="m", error_module="numpy"))
    assert type(other) is EngineCoreDeadError and "Boom: m" in str(other)


def test_a_field_left_out_takes_its_default():
    fields = encode_params(SamplingParams(max_tokens=3))
    del fields["min_p"]
    assert decode_params(fields) == SamplingParams(max_tokens=3)


# mp_llm: tests/engine/conftest.py's (ENGINE's settings, its core in a process of its own).


def test_the_core_runs_in_another_process_and_matches_in_process(mp_llm, tiny_llama_dir,
                                                                  monkeypatch):
    assert mp_llm.llm_engine.engine_core.pid != os.getpid()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    got = mp_llm.generate(PROMPTS, params, use_tqdm=False)
    monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "0")
    here = LLM(model=str(tiny_llama_dir), **ENGINE)
    try:
        assert here.llm_engine.engine_core.pid == os.getpid()
        want = here.generate(PROMPTS, params, use_tqdm=False)
    finally:
        here.shutdown()
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
        assert [sorted(d) for d in g.outputs[0].logprobs] == \
            [sorted(d) for d in w.outputs[0].logprobs]


def test_a_collective_rpc_past_its_timeout_raises_and_its_late_answer_is_dropped(mp_llm):
    with pytest.raises(TimeoutError, match="'weights_missing' did not finish within its "
                                           "timeout of 1e-09 s"):
        mp_llm.collective_rpc("weights_missing", timeout=1e-9)
    assert mp_llm.collective_rpc("weights_missing", timeout=60) == [0]
    out = mp_llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_the_cores_openmp_threads_spin_briefly_unless_the_user_chose():
    from kiln.engine.core_interpreter import CORE_SPIN_COUNT, core_environment

    assert core_environment({"A": "1"}) == {"A": "1", "GOMP_SPINCOUNT": str(CORE_SPIN_COUNT)}
    assert core_environment({"GOMP_SPINCOUNT": "7"})["GOMP_SPINCOUNT"] == "7"
    chose = core_environment({"OMP_WAIT_POLICY": "PASSIVE"})
    assert chose == {"OMP_WAIT_POLICY": "PASSIVE"}  # a policy alone keeps libgomp's count


def test_the_live_core_has_that_environment(mp_llm):
    from kiln.engine.core_interpreter import core_environment

    pid = mp_llm.llm_engine.engine_core.pid
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    env = dict(item.decode().split("=", 1) for item in raw if b"=" in item)
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        assert env.get(name) == core_environment(os.environ).get(name), name


def test_stats_are_fresh_after_an_abort(mp_llm):
    engine = mp_llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3]},
                       SamplingParams(max_tokens=40, ignore_eos=True))
    while not engine.step():
        pass  # until its prefill ran: it holds blocks
    assert engine.get_stats()["num_running"] == 1
    engine.abort_request("a")
    stats = engine.get_stats()
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
    assert not engine.has_unfinished_requests()


def test_each_core_steps_tokens_are_reported_apart(mp_llm):
    """Whether the front end reads each core step as it comes or several at once (a core that
    ran ahead), the engine reports each core step's tokens apart (iteration_tokens_total), and
    a poll that found no step reports none."""
    engine = mp_llm.llm_engine
    engine.add_request("s", {"prompt_token_ids": [1, 2, 3]},
                       SamplingParams(max_tokens=6, ignore_eos=True))
    time.sleep(0.5)  # the core may run ahead meanwhile; the totals are the same either way
    totals = []
    while engine.has_unfinished_requests():
        engine.step()
        totals += [s.tokens for s in engine.last_steps]
    assert totals == [3 + 1] + [1] * 5


def test_a_core_start_up_error_keeps_its_kind_and_message(tiny_llama_dir, capfd):
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        LLM(model=str(tiny_llama_dir), enforce_eager=True, max_model_len=64,
            kv_cache_memory=1e-9)
    # a setting the user must change is one line from the front end, not the core's traceback
    assert "Traceback" not in capfd.readouterr().err


def test_a_kv_cache_smaller_than_one_request_refuses_or_caps(tiny_llama_dir):
    """vLLM's check: one max_model_len request must fit, never be cut short with "length".
    Two blocks of 16 tokens (8 KiB each on this model) hold 32 tokens."""
    tiny = dict(enforce_eager=True, kv_cache_memory=20_000 / 2 ** 30)
    with pytest.raises(ValueError, match=r"To serve at least one request with the model's max "
                       r"seq len \(64\), \(32.00 KiB KV cache is needed, which is larger "
                       r"than the available KV cache memory \(16.00 KiB\).*estimated maximum "
                       r"model length is 32"):
        LLM(model=str(tiny_llama_dir), max_model_len=64, **tiny)
    llm = LLM(model=str(tiny_llama_dir), **tiny)  # the model's own max_model_len: capped
    try:
        assert llm.llm_engine.max_model_len == 32  # the config keeps the model's
        with pytest.raises(ValueError, match="max_model_len 32"):
            llm.generate({"prompt_token_ids": list(range(1, 33))}, use_tqdm=False)
        (out,) = llm.generate({"prompt_token_ids": list(range(1, 20))},
                              SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 32 - 19
    finally:
        llm.shutdown()


def test_a_prestarted_core_interpreter_serves_the_next_engine_or_ends_at_exit(tiny_llama_dir):
    import subprocess
    import sys

    from kiln.engine import core_interpreter

    core_interpreter.prestart()
    prestarted = core_interpreter._prestarted[0]
    llm = LLM(model=str(tiny_llama_dir), **ENGINE)
    try:
        assert llm.llm_engine.engine_core.pid == prestarted.proc.pid
        assert not core_interpreter._prestarted  # taken once
    finally:
        llm.shutdown()
    # A command that fails before its engine exists leaves no core process behind.
    code = ("import sys; from kiln.engine import core_interpreter as c; c.prestart(); "
            "print(c._prestarted[0].proc.pid, flush=True); sys.exit(2)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2
    pid = int(done.stdout.strip())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_generate_from_several_threads_runs_one_batch_at_a_time(mp_llm):
    """A second thread's step loop took the first's finished outputs and dropped them: 'engine
    dropped requests' (an in-process core: its forward is not re-entrant)."""
    import concurrent.futures

    params = SamplingParams(temperature=0, max_tokens=6)
    want = [o.outputs[0].token_ids for o in mp_llm.generate(PROMPTS, params, use_tqdm=False)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        runs = [pool.submit(mp_llm.generate, PROMPTS, params, use_tqdm=False) for _ in range(6)]
        for run in runs:
            assert [o.outputs[0].token_ids for o in run.result()] == want


def test_reset_prefix_cache_while_another_thread_generates(mp_llm):
    """The batch's step loop read the reset's answer from the core and dropped it: the reset
    then waited for good. (The module's engine: a reset changes no later answer.)"""
    import threading

    llm = mp_llm
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    started = threading.Event()
    results = []

    def generate():
        started.set()
        results.append(llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 4, params,
                                    use_tqdm=False))
    batch = threading.Thread(target=generate, daemon=True)
    batch.start()
    started.wait()
    resets = threading.Thread(target=lambda: [llm.reset_prefix_cache() for _ in range(10)],
                              daemon=True)
    resets.start()
    resets.join(60)
    batch.join(60)
    assert not resets.is_alive(), "reset_prefix_cache hangs beside a running batch"
    assert len(results) == 1 and all(len(o.outputs[0].token_ids) == 40 for o in results[0])


class PrecisionNamingExecutor:
    """Fails the core's start-up naming torch's float32 matmul precision there."""

    def __init__(self, kiln_config):
        import torch

        from kiln.errors import ConfigError

        raise ConfigError(f"core float32 matmul precision: {torch.get_float32_matmul_precision()}")


def test_the_core_loads_under_the_callers_float32_matmul_precision(tiny_llama_dir):
    # docs/models.md's torch.set_float32_matmul_precision("high") before loading (a GGUF model's
    # float32 kernels read it at load) reached only an in-process core: the core's own
    # interpreter kept torch's default.
    import torch

    from kiln.engine.arg_utils import EngineArgs
    from kiln.engine.llm_engine import LLMEngine
    from kiln.errors import ConfigError

    config = EngineArgs(model=str(tiny_llama_dir), **ENGINE).create_kiln_config()
    before = torch.get_float32_matmul_precision()
    try:
        for precision in ("high", "highest"):
            torch.set_float32_matmul_precision(precision)
            with pytest.raises(ConfigError, match=f"precision: {precision}$"):
                LLMEngine(config, executor_class=PrecisionNamingExecutor, multiprocess=True)
    finally:
        torch.set_float32_matmul_precision(before)


def test_an_int_past_64_bits_is_refused_before_the_batch_is_queued(mp_llm):
    """A number past 64 bits in a schema (or any field, set after the params were built) reached
    the core client's msgpack encoder: an OverflowError with the batch's earlier prompts already
    queued. It is a ValueError naming the field, raised before any prompt is queued."""
    params = SamplingParams(temperature=0, max_tokens=4)
    want = [o.outputs[0].token_ids for o in mp_llm.generate(PROMPTS, params, use_tqdm=False)]
    bad = SamplingParams(temperature=0, max_tokens=4,
                         structured_outputs=StructuredOutputsParams(json={"enum": [1, 2]}))
    bad.structured_outputs.json["enum"][1] = 2 ** 64  # a schema the grammar compiler takes
    with pytest.raises(ValueError, match=r"prompt 1: structured_outputs.json\['enum'\]\[1\] "
                                         r"must be within a 64-bit integer's range"):
        mp_llm.generate(PROMPTS, [params, bad], use_tqdm=False)
    assert not mp_llm.llm_engine.has_unfinished_requests()
    assert [o.outputs[0].token_ids for o in mp_llm.generate(PROMPTS, params, use_tqdm=False)] \
        == want
