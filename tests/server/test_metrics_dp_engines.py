"""With data parallel, request-level metrics are per replica, as vLLM's: latencies, token
counters, finish reasons and step tokens carry the `engine` label of the replica that served
the request (vllm/v1/metrics/loggers.py labels every series with engine = its index)."""
import asyncio
import threading

from prometheus_client.parser import text_string_to_metric_families

from kiln.engine.async_llm import AsyncLLM
from kiln.engine.dp_core_client import DPCoreClient
from kiln.engine.engine_token_stats import StepTokens
from kiln.entrypoints.openai.metrics import ServerMetrics
from kiln.sampling_params import RequestOutputKind, SamplingParams

from .fake_engine import FakeEngine


class TwoReplicaEngine(FakeEngine):
    """As LLMEngine over DPCoreClient: requests go to replicas 0, 1, 0, ... in turn; each
    replica's outputs of a step are a core step of their own."""

    def __init__(self):
        super().__init__()
        self.replica: dict[str, int] = {}

    def add_processed_request(self, request_id, processed, arrival_time=None, *, priority=0):
        super().add_processed_request(request_id, processed, arrival_time, priority=priority)
        self.replica[request_id] = len(self.replica) % 2
        return self.replica[request_id]

    def step(self):
        outputs = super().step()
        by_request = self.last_steps[0].by_request if self.last_steps else {}
        steps = [StepTokens(r, {rid: n for rid, n in by_request.items()
                                if self.replica[rid] == r}) for r in (0, 1)]
        self.last_steps = [s for s in steps if s.by_request]
        return outputs


def samples(metrics: ServerMetrics) -> dict:
    return {(s.name, s.labels.get("engine"), s.labels.get("finished_reason")): s.value
            for f in text_string_to_metric_families(metrics.render().decode())
            for s in f.samples if "le" not in s.labels}


def test_request_metrics_are_labelled_with_the_replica_that_served_them():
    metrics = ServerMetrics("m", log_interval=None, num_engines=2)
    before = samples(metrics)
    # every replica's series exist at 0 before its first request (dashboards' rate())
    assert before["kiln:request_success_total", "1", "length"] == 0
    assert before["kiln:time_to_first_token_seconds_count", "1", None] == 0
    llm = AsyncLLM(TwoReplicaEngine(), [metrics])

    async def one(rid, prompt, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA)
        return [out async for out in llm.generate(prompt, params, rid)]

    async def main():
        return await asyncio.gather(one("a", "abc", 3), one("b", "abcdefg", 2))

    asyncio.run(main())
    s = samples(metrics)
    for engine, prompt, generated in (("0", 4, 3), ("1", 8, 2)):  # prompts with BOS
        assert s["kiln:request_success_total", engine, "length"] == 1
        assert s["kiln:time_to_first_token_seconds_count", engine, None] == 1
        assert s["kiln:e2e_request_latency_seconds_count", engine, None] == 1
        assert s["kiln:inter_token_latency_seconds_count", engine, None] == generated - 1
        assert s["kiln:prompt_tokens_total", engine, None] == prompt
        assert s["kiln:generation_tokens_total", engine, None] == generated
        assert s["kiln:iteration_tokens_total_sum", engine, None] == prompt + generated


def test_a_replicas_step_tokens_leave_out_a_request_aborted_while_its_step_ran():
    """Replica 1's request is aborted on the event loop while the engine thread runs a step
    that computed its second token: that token reaches no stream, so no counter, and (as
    vLLM's iteration stats) not replica 1's iteration_tokens_total either, which read one
    more than its prompt + generated tokens."""
    metrics = ServerMetrics("m", log_interval=None, num_engines=2)
    engine = TwoReplicaEngine()
    stepped, resume = threading.Event(), threading.Event()
    step = engine.step

    def gated_step():
        outputs = step()
        if engine.requests.get("b", {}).get("k") == 2:
            stepped.set()
            resume.wait(30)
        return outputs

    engine.step = gated_step
    llm = AsyncLLM(engine, [metrics])

    async def one(rid, prompt, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA)
        return [out async for out in llm.generate(prompt, params, rid)]

    async def main():
        a = asyncio.create_task(one("a", "abc", 4))
        b = asyncio.create_task(one("b", "abcdefg", 8))
        await asyncio.get_running_loop().run_in_executor(None, stepped.wait, 30)
        llm.abort_nowait("b")
        resume.set()
        await asyncio.gather(a, b)

    asyncio.run(main())
    s = samples(metrics)
    for engine_label, prompt, generated in (("0", 4, 4), ("1", 8, 1)):  # prompts with BOS
        assert s["kiln:prompt_tokens_total", engine_label, None] == prompt
        assert s["kiln:generation_tokens_total", engine_label, None] == generated
        assert s["kiln:iteration_tokens_total_sum", engine_label, None] == prompt + generated


def test_the_dp_client_names_each_steps_replica():
    """DPCoreClient.step's steps come with their replicas (LLMEngine labels step tokens)."""
    class Replica:
        def __init__(self, steps):
            self.steps = steps

        def step(self, wait_ms):
            return self.steps

    client = DPCoreClient.__new__(DPCoreClient)
    client.clients = [Replica([["a"], ["b"]]), Replica([]), Replica([["c"]])]
    assert client._steps(client.clients) == [["a"], ["b"], ["c"]]
    assert client.last_step_engines == [0, 0, 2]
