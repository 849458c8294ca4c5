"""kiln:iteration_tokens_total observes one value per engine core step with outputs, as vLLM's:
not the front end's polls that found no step, and not several core steps merged into one."""
import asyncio
import collections

from prometheus_client.parser import text_string_to_metric_families

from kiln.core.core_messages import StepOutputs
from kiln.core.outputs import EngineCoreOutput
from kiln.core.stats import SchedulerStats
from kiln.engine.async_llm import AsyncLLM
from kiln.engine.core_client import CoreProcClient
from kiln.entrypoints.openai.metrics import ServerMetrics
from kiln.sampling_params import RequestOutputKind, SamplingParams

from .fake_engine import FakeEngine


def test_the_core_client_keeps_each_core_steps_outputs_apart():
    """A core that ran ahead sent several StepOutputs before the front end read one: step()
    returns them one list per core step (a step without outputs too), the latest stats kept."""
    client = CoreProcClient.__new__(CoreProcClient)
    a1, b1 = EngineCoreOutput("a", [5]), EngineCoreOutput("b", [6])
    a2 = EngineCoreOutput("a", [7], finish_reason="length")
    messages = collections.deque([StepOutputs([a1, b1], SchedulerStats(num_running=2)),
                                  StepOutputs([], SchedulerStats(num_running=2)),
                                  StepOutputs([a2], SchedulerStats(num_running=1))])
    client._recv = lambda timeout_ms: messages.popleft() if messages else None
    client._pending = collections.deque()
    client._unfinished = {"a": 0, "b": 0}
    client._last_stats = SchedulerStats()
    assert client.step() == [[a1, b1], [], [a2]]
    assert client.step_stats().num_running == 1
    assert set(client._unfinished) == {"b"}
    assert client.step() == []  # a poll that found nothing


class PollingEngine(FakeEngine):
    """As LLMEngine over a core process: every other call is a poll that found no step, and
    the calls between take in two core steps at once (the core ran ahead)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def step(self):
        self.calls += 1
        if self.calls % 2:
            self.last_steps = []
            return []
        outputs = super().step()
        steps = list(self.last_steps)
        if self.requests:
            outputs += super().step()
            steps += self.last_steps
        self.last_steps = steps
        return outputs


def scrape(metrics: ServerMetrics) -> dict:
    return {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode())
            for s in f.samples if s.name.startswith("kiln:iteration_tokens_total")
            and s.labels.get("le") in (None, "1.0")}


def test_one_observation_per_core_step_with_outputs():
    metrics = ServerMetrics("fake-model", log_interval=None)
    engine = PollingEngine()
    llm = AsyncLLM(engine, [metrics])

    async def main():
        params = SamplingParams(max_tokens=5, output_kind=RequestOutputKind.DELTA)
        return [out async for out in llm.generate("abc", params, "r")]

    outs = asyncio.run(main())
    assert outs[-1].finished and engine.calls > 5  # polls and merged steps both happened
    s = scrape(metrics)
    # Five core steps of one sequence: the first prefills its 4 prompt tokens; 1 token each.
    assert s["kiln:iteration_tokens_total_count"] == 5
    assert s["kiln:iteration_tokens_total_sum"] == 4 + 5
    assert s["kiln:iteration_tokens_total_bucket"] == 4  # no step of 0 tokens
