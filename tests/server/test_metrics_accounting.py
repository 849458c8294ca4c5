"""GET /metrics against ground truth after known workloads on the fake engine: token counters,
latency histogram counts, finish-reason labels, n > 1, aborts, 400s, engine-total counters."""
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kiln.config import CacheConfig
from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai.api_server import ServerSettings, build_app
from kiln.sampling_params import RequestOutputKind, SamplingParams

from .fake_engine import FakeEngine

MODEL = "fake-model"
PROMPT = "abc"  # the fake tokenizer: BOS + one id per character = 4 tokens


class CountingEngine(FakeEngine):
    """Adds the engine totals a real LLMEngine reports (prefix cache, preemptions)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.totals = dict(prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0)
        self.fail_with: str | None = None  # an error that ends every request at its next step

    def get_stats(self):
        return {**super().get_stats(), **self.totals}

    def step(self):
        outputs = super().step()
        if self.fail_with is not None:  # as the core ends a request it cannot serve
            for out in outputs:
                for o in out.outputs:
                    o.finish_reason, o.error = "abort", self.fail_with
                out.finished = True
                self.requests.pop(out.request_id, None)
        return outputs


@pytest.fixture()
def server():
    engine = CountingEngine(max_model_len=64)
    llm = AsyncLLM(engine)
    with TestClient(build_app(llm, ServerSettings())) as c:
        yield c, engine, llm


def samples(client) -> dict:
    out = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            key = s.name
            if not key.startswith("kiln:"):  # the process's own (memory, CPU) move anyway
                continue
            if "finished_reason" in s.labels:
                key += "{" + s.labels["finished_reason"] + "}"
            elif "le" in s.labels:
                continue
            out[key] = out.get(key, 0) + s.value
    return out


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def test_success_labels_exist_from_the_start(server):
    """A dashboard's rate() over request_success{finished_reason="abort"} needs the series at 0."""
    c, _, _ = server
    s = samples(c)
    for reason in ("stop", "length", "abort", "error"):
        assert s[f"kiln:request_success_total{{{reason}}}"] == 0


def test_one_request_ground_truth(server):
    c, _, _ = server
    before = samples(c)
    r = c.post("/v1/completions", json=dict(model=MODEL, prompt=PROMPT, max_tokens=5))
    assert r.status_code == 200
    d = delta(before, samples(c))
    assert d["kiln:prompt_tokens_total"] == 4
    assert d["kiln:generation_tokens_total"] == 5
    assert d["kiln:request_success_total{length}"] == 1
    assert d["kiln:time_to_first_token_seconds_count"] == 1
    assert d["kiln:inter_token_latency_seconds_count"] == 4
    assert d["kiln:e2e_request_latency_seconds_count"] == 1
    assert d["kiln:request_prompt_tokens_count"] == 1
    assert d["kiln:request_prompt_tokens_sum"] == 4
    assert d["kiln:request_generation_tokens_count"] == 1
    assert d["kiln:request_generation_tokens_sum"] == 5
    assert d["kiln:request_decode_time_seconds_count"] == 1
    assert 0 <= d.get("kiln:request_decode_time_seconds_sum", 0) <= \
        d["kiln:e2e_request_latency_seconds_sum"]
    after = samples(c)
    assert after["kiln:num_requests_running"] == after["kiln:num_requests_waiting"] == 0
    assert after["kiln:kv_cache_usage_perc"] == 0


def test_n_samples_each_count_as_a_finished_request(server):
    """As vLLM v1, which runs each of the n samples as a child request: each is prefilled (its
    prompt counts n times), succeeds, and has its own TTFT, e2e, prompt and generated tokens
    and max_tokens; only n and the longest sample's tokens are observed once per request."""
    c, _, _ = server
    before = samples(c)
    r = c.post("/v1/completions", json=dict(model=MODEL, prompt=PROMPT, max_tokens=3, n=2))
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    d = delta(before, samples(c))
    assert d["kiln:prompt_tokens_total"] == 2 * 4
    assert d["kiln:generation_tokens_total"] == 2 * 3
    assert d["kiln:inter_token_latency_seconds_count"] == 2 * (3 - 1)
    assert d["kiln:time_to_first_token_seconds_count"] == 2
    assert d["kiln:request_success_total{length}"] == 2
    assert d["kiln:e2e_request_latency_seconds_count"] == 2
    assert d["kiln:request_prompt_tokens_count"] == 2
    assert d["kiln:request_prompt_tokens_sum"] == 2 * 4
    assert d["kiln:request_generation_tokens_count"] == 2
    assert d["kiln:request_generation_tokens_sum"] == 6  # 3 each
    assert d["kiln:request_decode_time_seconds_count"] == 2
    assert d["kiln:request_params_max_tokens_count"] == 2
    assert d["kiln:request_params_n_count"] == 1 and d["kiln:request_params_n_sum"] == 2
    assert d["kiln:request_max_num_generation_tokens_count"] == 1
    assert d["kiln:request_max_num_generation_tokens_sum"] == 3


def test_each_sample_is_labelled_by_its_own_finish_reason(server):
    """n=2 where a stop string ends one sample and max_tokens the other: one success each."""
    c, _, _ = server
    first = c.post("/v1/completions", json=dict(model=MODEL, prompt=PROMPT, max_tokens=3, n=2)
                   ).json()["choices"]
    texts = {ch["index"]: ch["text"].split() for ch in first}
    assert not set(texts[0]) & set(texts[1])  # the stop string below is in sample 0 alone
    before = samples(c)
    r = c.post("/v1/completions", json=dict(model=MODEL, prompt=PROMPT, max_tokens=3, n=2,
                                            stop=[texts[0][0]]))
    reasons = {ch["index"]: ch["finish_reason"] for ch in r.json()["choices"]}
    assert reasons == {0: "stop", 1: "length"}
    d = delta(before, samples(c))
    assert d["kiln:request_success_total{stop}"] == 1
    assert d["kiln:request_success_total{length}"] == 1


def test_max_tokens_observed_is_the_engines_where_the_request_set_none(server):
    """As vLLM's request_params_max_tokens: the room the engine left beside the prompt
    (max_model_len 64 here), not nothing."""
    c, _, _ = server
    before = samples(c)
    r = c.post("/v1/chat/completions", json=dict(model=MODEL, messages=[
        {"role": "user", "content": "hi"}]))
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    r = c.post("/v1/completions", json=dict(model=MODEL, prompt=PROMPT, max_tokens=None))
    assert r.json()["usage"]["completion_tokens"] == 64 - 4
    d = delta(before, samples(c))
    assert d["kiln:request_params_max_tokens_count"] == 2
    assert d["kiln:request_params_max_tokens_sum"] == (64 - prompt_tokens) + (64 - 4)


def test_stop_reason_label(server):
    c, _, _ = server
    before = samples(c)
    # The fake engine's first token for "abc" decodes to text containing its id; stop on it.
    first = c.post("/v1/completions", json=dict(model=MODEL, prompt=PROMPT, max_tokens=1)
                   ).json()["choices"][0]["text"].strip()
    mid = samples(c)
    c.post("/v1/completions", json=dict(model=MODEL, prompt=PROMPT, max_tokens=5, stop=[first]))
    d = delta(mid, samples(c))
    assert d["kiln:request_success_total{stop}"] == 1
    assert "kiln:request_success_total{length}" not in d
    assert delta(before, mid)["kiln:request_success_total{length}"] == 1


def test_rejected_request_touches_no_counter(server):
    c, _, _ = server
    before = samples(c)
    r = c.post("/v1/completions", json=dict(model=MODEL, prompt="x" * 80, max_tokens=2))
    assert r.status_code == 400
    assert delta(before, samples(c)) == {}


def test_rejected_batch_touches_no_counter(server):
    c, _, _ = server
    before = samples(c)
    r = c.post("/v1/completions", json=dict(model=MODEL, prompt=["ok", "x" * 80], max_tokens=2))
    assert r.status_code == 400
    d = delta(before, samples(c))
    assert not any(k.startswith("kiln:request_success") for k in d), d


def test_abort_counts_once_as_abort_never_success(server):
    c, engine, llm = server
    engine.step_delay = 0.02
    before = samples(c)

    async def leave_early():
        params = SamplingParams(max_tokens=50, output_kind=RequestOutputKind.DELTA)
        agen = llm.generate(PROMPT, params, "leaver")
        async for _ in agen:
            break
        await agen.aclose()  # the client went away: generate's cleanup aborts
        await llm.get_stats()  # runs after the queued abort on the engine thread

    c.portal.call(leave_early)
    d = delta(before, samples(c))
    assert d["kiln:request_success_total{abort}"] == 1
    assert not any(k in d for k in ("kiln:request_success_total{stop}",
                                    "kiln:request_success_total{length}"))
    assert d["kiln:e2e_request_latency_seconds_count"] == 1
    assert d["kiln:time_to_first_token_seconds_count"] == 1
    after = samples(c)
    assert after["kiln:num_requests_running"] == 0 and after["kiln:kv_cache_usage_perc"] == 0


def test_a_request_the_engine_failed_counts_as_error(server):
    """The engine ended it with an error (a 400 request_failed): vLLM v1's "error" label, not
    "abort", which is left to requests their caller gave up."""
    c, engine, _ = server
    engine.fail_with = "json_schema allows no token after 1 generated token(s)"
    before = samples(c)
    r = c.post("/v1/completions", json=dict(model=MODEL, prompt=PROMPT, max_tokens=5))
    assert r.status_code == 400 and r.json()["error"]["code"] == "request_failed"
    d = delta(before, samples(c))
    assert d["kiln:request_success_total{error}"] == 1
    assert "kiln:request_success_total{abort}" not in d
    assert "kiln:request_queue_time_seconds_count" not in d


def test_engine_totals_are_exported_as_counters(server):
    """Prefix cache queries / hits and preemptions are engine totals; they become counters."""
    c, engine, _ = server
    before = samples(c)
    engine.totals.update(prefix_cache_queries=64, prefix_cache_hits=32, num_preemptions=2)
    d = delta(before, samples(c))
    assert d["kiln:prefix_cache_queries_total"] == 64
    assert d["kiln:prefix_cache_hits_total"] == 32
    assert d["kiln:num_preemptions_total"] == 2
    engine.totals.update(prefix_cache_queries=80, prefix_cache_hits=32, num_preemptions=2)
    d = delta(before, samples(c))
    assert d["kiln:prefix_cache_queries_total"] == 80
    assert d["kiln:prefix_cache_hits_total"] == 32  # a second scrape adds nothing new


def test_the_cache_config_info_names_the_kv_cache_dtype():
    """vLLM's cache_config_info carries cache_dtype: whether the KV cache is fp8 shows."""
    engine = CountingEngine()
    engine.kiln_config.cache_config = CacheConfig(block_size=16, cache_dtype="fp8_e5m2")
    with TestClient(build_app(AsyncLLM(engine), ServerSettings())) as c:
        (info,) = [s for f in text_string_to_metric_families(c.get("/metrics").text)
                   for s in f.samples if s.name == "kiln:cache_config_info"]
    assert info.labels["cache_dtype"] == "fp8_e5m2" and info.labels["block_size"] == "16"


def test_metric_types_match_vllms():
    """Names are vLLM's with kiln: for vllm:, and the types agree, so dashboards port by rename."""
    llm = AsyncLLM(CountingEngine())
    app = build_app(llm, ServerSettings())
    with TestClient(app) as c:
        types = {f.name: f.type for f in
                 text_string_to_metric_families(c.get("/metrics").text)}
    expected = {
        "kiln:num_requests_running": "gauge", "kiln:num_requests_waiting": "gauge",
        "kiln:kv_cache_usage_perc": "gauge", "kiln:prompt_tokens": "counter",
        "kiln:generation_tokens": "counter", "kiln:request_success": "counter",
        "kiln:prefix_cache_queries": "counter", "kiln:prefix_cache_hits": "counter",
        "kiln:num_preemptions": "counter",
        "kiln:time_to_first_token_seconds": "histogram",
        "kiln:inter_token_latency_seconds": "histogram",
        "kiln:e2e_request_latency_seconds": "histogram",
        "kiln:request_prompt_tokens": "histogram",
        "kiln:request_generation_tokens": "histogram",
        "kiln:request_decode_time_seconds": "histogram",
        "kiln:request_queue_time_seconds": "histogram",
        "kiln:request_prefill_time_seconds": "histogram",
        "kiln:request_inference_time_seconds": "histogram",
    }
    for name, kind in expected.items():
        assert types.get(name) == kind, (name, types.get(name))

