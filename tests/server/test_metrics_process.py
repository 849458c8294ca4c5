"""GET /metrics carries the server process's own series (memory, file descriptors, CPU, the
garbage collector, the Python build), as vLLM's does from prometheus_client's default registry:
a dashboard or leak alert built on process_resident_memory_bytes found nothing on Kiln."""
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai.api_server import ServerSettings, build_app

from .fake_engine import FakeEngine


def test_metrics_has_the_process_series():
    with TestClient(build_app(AsyncLLM(FakeEngine()), ServerSettings())) as c:
        text = c.get("/metrics").text
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["process_resident_memory_bytes"].value > 10 * 2**20
    assert 3 < samples["process_open_fds"].value <= samples["process_max_fds"].value
    assert samples["process_cpu_seconds_total"].value > 0
    assert "python_gc_objects_collected_total" in samples and "python_info" in samples
    # the engine core's series name their engine, as vLLM's (one per data-parallel replica)
    assert samples["kiln:num_requests_running"].labels == {"model_name": "fake-model",
                                                           "engine": "0"}


def test_two_servers_in_one_process_each_have_them():
    """Each ServerMetrics owns its registry: a second app (tests, or two servers) must not
    collide over the process collectors."""
    apps = [build_app(AsyncLLM(FakeEngine()), ServerSettings()) for _ in range(2)]
    for app in apps:
        assert b"process_resident_memory_bytes" in app.state.metrics.render()
