"""Queue / prefill / inference histograms on a tiny real engine: built on the scheduler's own
first-scheduled stamps, consistent with TTFT and decode time, and not observed for aborts."""
import asyncio
import math
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kiln.core.outputs import EngineCoreOutput
from kiln.core.parent_request import child_params, child_request_id
from kiln.engine.arg_utils import EngineArgs
from kiln.engine.async_llm import AsyncLLM
from kiln.engine.llm_engine import LLMEngine
from kiln.engine.output_processor import OutputProcessor
from kiln.engine.request_stats import IterationStats, RequestTimer
from kiln.entrypoints.openai.metrics import ServerMetrics
from kiln.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kiln.sampling_params import RequestOutputKind, SamplingParams

PHASES = ("queue", "prefill", "inference")


@pytest.fixture(scope="module")
def engine(inprocess_core, tiny_llama_dir):
    # One sequence at a time: requests sent together really queue behind each other. The core
    # in this process: the test reads the stamps on the core's own Request objects.
    eng = LLMEngine.from_engine_args(EngineArgs(
        model=str(tiny_llama_dir), enforce_eager=True, max_model_len=128, max_num_seqs=1,
        kv_cache_memory=0.02))
    # Keep every core request the engine creates, to read its stamp after it is gone.
    # The scheduler's: the core makes an n > 1 request's samples itself.
    core_requests = {}
    scheduler = eng.engine_core.core.scheduler
    add = scheduler.add_request

    def recording_add(request):
        core_requests[request.request_id] = request
        add(request)

    scheduler.add_request = recording_add
    eng.core_requests = core_requests
    yield eng
    eng.shutdown()


def scrape(metrics: ServerMetrics) -> dict:
    """Sample name -> value (histogram buckets left out, labels summed)."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if "le" not in s.labels:
                out[s.name] = out.get(s.name, 0) + s.value
    return out


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}


async def run_together(llm: AsyncLLM, jobs: dict) -> dict:
    """Send every request at once (explicit arrival times); drain them all."""
    arrivals = {}

    async def one(rid, params):
        arrivals[rid] = time.monotonic()
        stream = await llm.add_request(rid, {"prompt_token_ids": [5, 6, 7, 8, 9]}, params,
                                       arrival_time=arrivals[rid])
        return [out async for out in stream]

    results = await asyncio.gather(*(one(rid, p) for rid, p in jobs.items()))
    assert all(outs[-1].finished for outs in results)
    return arrivals


def test_phase_histograms_from_scheduler_stamps(engine):
    metrics = ServerMetrics("tiny", log_interval=None)
    llm = AsyncLLM(engine, [metrics])
    jobs = {f"r{i}": SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
            for i in range(3)}
    jobs["n2"] = SamplingParams(n=2, max_tokens=3, ignore_eos=True, temperature=1.0, seed=3)
    before = scrape(metrics)
    arrivals = asyncio.run(run_together(llm, jobs))
    d = delta(before, scrape(metrics))

    finished = len(jobs) + 1  # samples, as vLLM's child requests: n=2 finishes twice
    for phase in PHASES:
        assert d[f"kiln:request_{phase}_time_seconds_count"] == finished, phase
    assert d["kiln:time_to_first_token_seconds_count"] == finished

    # The queue time is exactly the core's first scheduling minus the arrival; each sample of
    # the n=2 request from its own (max_num_seqs=1 runs the samples one after another).
    core = engine.core_requests
    stamps = {rid: core[rid].first_scheduled_time for rid in jobs if rid in core}
    first, second = (core[child_request_id(i, "n2")].first_scheduled_time for i in range(2))
    assert first < second
    expected_queue = sum(stamps[rid] - arrivals[rid] for rid in stamps) + \
        first + second - 2 * arrivals["n2"]
    assert math.isclose(d["kiln:request_queue_time_seconds_sum"], expected_queue, abs_tol=1e-6)
    # One sequence at a time: the requests behind the first one waited for it.
    assert expected_queue > 0 and max(stamps.values()) - min(stamps.values()) > 0

    # queue + prefill = TTFT and inference = prefill + decode, sample by sample.
    queue, prefill = (d[f"kiln:request_{p}_time_seconds_sum"] for p in ("queue", "prefill"))
    inference = d["kiln:request_inference_time_seconds_sum"]
    decode = d["kiln:request_decode_time_seconds_sum"]
    assert math.isclose(queue + prefill, d["kiln:time_to_first_token_seconds_sum"],
                        abs_tol=1e-6)
    assert prefill > 0 and inference >= decode > 0
    assert math.isclose(inference, prefill + decode, abs_tol=1e-6)
    assert inference <= d["kiln:e2e_request_latency_seconds_sum"]


def test_aborted_request_observes_no_phase(engine):
    metrics = ServerMetrics("tiny", log_interval=None)
    llm = AsyncLLM(engine, [metrics])

    async def leave_after_first_token():
        params = SamplingParams(max_tokens=60, ignore_eos=True, temperature=0,
                                output_kind=RequestOutputKind.DELTA)
        stream = await llm.add_request("leaver", {"prompt_token_ids": [5, 6, 7]}, params)
        async for _ in stream:
            break
        await llm.abort("leaver")

    before = scrape(metrics)
    asyncio.run(leave_after_first_token())
    d = delta(before, scrape(metrics))
    assert d["kiln:request_success_total"] == 1  # counted, as an abort
    assert d["kiln:time_to_first_token_seconds_count"] == 1
    for phase in PHASES:
        assert d[f"kiln:request_{phase}_time_seconds_count"] == 0, phase


def test_output_processor_takes_the_earliest_sample_stamp(engine):
    """n > 1: the samples are scheduled apart; RequestOutput.metrics is the earliest, whichever
    sample reports first, and is None until one was scheduled."""
    proc = OutputProcessor(engine.tokenizer)
    params = SamplingParams(n=2, max_tokens=2, output_kind=RequestOutputKind.DELTA)
    ids = [child_request_id(i, "p") for i in range(2)]
    proc.add_request("p", None, [5, 6], [(cid, child_params(params, i))
                                         for i, cid in enumerate(ids)], params.output_kind)
    (out,) = proc.process_outputs([EngineCoreOutput(ids[1], [9])]).request_outputs
    assert out.metrics is None
    (out,) = proc.process_outputs([EngineCoreOutput(ids[1], [9], first_scheduled_time=20.0)]
                                  ).request_outputs
    assert out.metrics.first_scheduled_time == 20.0
    (out,) = proc.process_outputs([EngineCoreOutput(ids[0], [9], first_scheduled_time=10.0)]
                                  ).request_outputs
    assert out.metrics.first_scheduled_time == 10.0
    (out,) = proc.process_outputs([EngineCoreOutput(ids[1], [9], finish_reason="length",
                                                    first_scheduled_time=20.0),
                                   EngineCoreOutput(ids[0], [9], finish_reason="length",
                                                    first_scheduled_time=10.0)]).request_outputs
    assert out.finished and out.metrics.first_scheduled_time == 10.0
    assert out.metrics.sample_first_scheduled_times == (10.0, 20.0)  # each sample's own


def test_timer_phases_per_request_and_none_for_a_core_abort():
    """Stamps straight into RequestTimer: the phases by definition; a request the core ended as
    aborted (after a token) observes none, as vLLM's."""
    def run(reason):
        timer, stats = RequestTimer(arrival_time=100.0), IterationStats()
        metrics = RequestMetrics(first_scheduled_time=100.5)
        for now, finish in ((101.0, None), (101.25, None), (102.0, reason)):
            out = RequestOutput("r", None, [1, 2], [CompletionOutput(0, "", [7],
                                                                     finish_reason=finish)],
                                finished=finish is not None, metrics=metrics)
            timer.observe(out, now, stats)
        return stats

    stats = run("length")
    assert stats.request_queue_times == [0.5]
    assert stats.request_prefill_times == [0.5]
    assert stats.request_inference_times == [1.5]
    assert stats.time_to_first_tokens == [1.0] and stats.request_decode_times == [1.0]
    aborted = run("abort")
    assert aborted.finished_reasons == ["abort"]
    assert aborted.request_queue_times == aborted.request_prefill_times == \
        aborted.request_inference_times == []


def test_tokens_that_arrive_together_are_one_inter_token_sample_each():
    """A delta of several core steps' tokens (the front end caught up): every token after a
    sample's first is one inter-token sample, the ones that came together 0 s apart."""
    timer, stats = RequestTimer(arrival_time=10.0), IterationStats()
    for now, ids in ((11.0, [5, 6]), (11.5, [7]), (12.5, [8, 9, 10])):
        timer.observe(RequestOutput("r", None, [1], [CompletionOutput(0, "", ids)]), now, stats)
    assert stats.inter_token_latencies == [0.0, 0.5, 1.0, 0.0, 0.0]  # 6 tokens: 5 gaps
    assert stats.time_to_first_tokens == [1.0] and stats.num_generation_tokens == 6


def test_request_params_and_step_token_histograms(engine):
    """vLLM's request_params_n and request_max_num_generation_tokens per finished request,
    request_params_max_tokens per finished sample (vLLM's child requests), and
    iteration_tokens_total per engine step, summing to the token counters; the KV cache's
    settings as an info gauge."""
    metrics = ServerMetrics("tiny", log_interval=None,
                            cache_info={"block_size": 16, "num_gpu_blocks": 7})
    llm = AsyncLLM(engine, [metrics])
    jobs = {"a": SamplingParams(max_tokens=4, ignore_eos=True, temperature=0),
            "n3": SamplingParams(n=3, max_tokens=5, min_tokens=2, temperature=1.0, seed=3)}
    before = scrape(metrics)
    asyncio.run(run_together(llm, jobs))
    d = delta(before, scrape(metrics))
    assert d["kiln:request_params_n_count"] == 2 and d["kiln:request_params_n_sum"] == 4
    assert d["kiln:request_params_max_tokens_count"] == 1 + 3
    assert d["kiln:request_params_max_tokens_sum"] == 4 + 3 * 5
    longest = d["kiln:request_max_num_generation_tokens_sum"] - 4  # "a": 4 tokens
    assert 2 <= longest <= 5
    assert d["kiln:iteration_tokens_total_sum"] == \
        d["kiln:prompt_tokens_total"] + d["kiln:generation_tokens_total"]
    assert d["kiln:iteration_tokens_total_count"] >= 4 + 2  # one step a token, one seq a step
    info = [s for f in text_string_to_metric_families(metrics.render().decode())
            for s in f.samples if s.name == "kiln:cache_config_info"]
    assert [(s.labels, s.value) for s in info] == [({"block_size": "16",
                                                     "num_gpu_blocks": "7"}, 1.0)]


def test_timer_observes_each_sample_of_n_as_a_finished_request():
    """As vLLM v1's child requests: each sample's own finish reason, e2e, TTFT, phases (from its
    own first scheduling), prompt and generated tokens and max_tokens, when it ends; n and the
    longest sample's tokens once, when the last one ends."""
    timer, stats = RequestTimer(arrival_time=100.0, n=2, max_tokens=8), IterationStats()
    first = RequestMetrics(100.5, (100.5, None))
    both = RequestMetrics(100.5, (100.5, 101.5))
    steps = [(101.0, first, [CompletionOutput(0, "", [7])]),
             (102.0, both, [CompletionOutput(0, "", [8], finish_reason="stop"),
                            CompletionOutput(1, "", [9])]),
             (103.0, both, [CompletionOutput(1, "", [10, 11], finish_reason="length")])]
    for now, metrics, outs in steps:
        timer.observe(RequestOutput("r", None, [1, 2, 3], outs, finished=now == 103.0,
                                    metrics=metrics), now, stats)
    assert stats.finished_reasons == ["stop", "length"]
    assert stats.e2e_latencies == [2.0, 3.0]
    assert stats.time_to_first_tokens == [1.0, 2.0]
    assert stats.inter_token_latencies == [1.0, 1.0, 0.0]
    assert stats.request_prompt_tokens == [3, 3]
    assert stats.request_generation_tokens == [2, 3]
    assert stats.request_params_max_tokens == [8, 8]
    assert stats.request_decode_times == [1.0, 1.0]
    assert stats.request_queue_times == [0.5, 1.5]
    assert stats.request_prefill_times == [0.5, 0.5]
    assert stats.request_inference_times == [1.5, 1.5]
    assert stats.request_params_n == [2] and stats.request_max_generation_tokens == [3]
    assert stats.num_prompt_tokens == 2 * 3 and stats.num_generation_tokens == 5


def test_an_abort_ends_each_sample_still_running():
    timer, stats = RequestTimer(arrival_time=10.0, n=3), IterationStats()
    timer.observe(RequestOutput("r", None, [1], [CompletionOutput(0, "", [7],
                                                                  finish_reason="length"),
                                                 CompletionOutput(1, "", [8])]), 11.0, stats)
    timer.observe_abort(12.0, stats)
    assert stats.finished_reasons == ["length", "abort", "abort"]
    assert stats.e2e_latencies == [1.0, 2.0, 2.0]
    assert stats.request_params_n == []  # the request did not finish


def test_a_step_that_ran_while_its_request_was_aborted_counts_no_iteration_token(
        engine, monkeypatch):
    """The engine thread steps while the event loop aborts: that step's token of the aborted
    request reaches no stream, so it is in no token counter, and (as vLLM's iteration stats,
    which drop an aborted request's outputs) not in iteration_tokens_total either; it read one
    more than prompt + generated tokens per such abort."""
    metrics = ServerMetrics("tiny", log_interval=None)
    llm = AsyncLLM(engine, [metrics])
    stepped, resume = threading.Event(), threading.Event()
    step, tokens = engine.step, []

    def gated_step():
        outputs = step()
        tokens.extend(t for o in outputs if o.request_id == "late" for t in o.outputs[0].token_ids)
        if len(tokens) == 2:  # its second token's step
            stepped.set()
            resume.wait(30)  # the request is aborted before its step's outputs are handed on
        return outputs

    monkeypatch.setattr(engine, "step", gated_step)

    async def abort_during_a_step():
        params = SamplingParams(max_tokens=60, ignore_eos=True, temperature=0)
        stream = await llm.add_request("late", {"prompt_token_ids": [5, 6, 7]}, params)
        await asyncio.get_running_loop().run_in_executor(None, stepped.wait, 30)
        llm.abort_nowait("late")
        resume.set()
        assert [out async for out in stream][-1].outputs[0].finish_reason == "abort"
        await llm.get_stats()  # after the abort ran on the engine thread

    before = scrape(metrics)
    asyncio.run(abort_during_a_step())
    d = delta(before, scrape(metrics))
    assert (d["kiln:prompt_tokens_total"], d["kiln:generation_tokens_total"]) == (3, 1)
    assert d["kiln:iteration_tokens_total_sum"] == 3 + 1
