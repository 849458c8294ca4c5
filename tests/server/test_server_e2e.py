"""End to end: the official `openai` client against a live `kiln serve` on stories260K.

One server (eager, small context, KILN_API_KEY set; conftest.py's, shared with
test_responses_server), on a free loopback port; the last test stops it with SIGTERM mid-request
and requires a clean exit.
"""
import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kiln.executor.free_port import free_port

from checkpoints import STORIES_DIR

KEY = "test-key"
NAME = "stories"
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def stories_with_chat_template(path: Path) -> Path:
    """stories260K copied to `path` with CHAT_TEMPLATE as its chat template."""
    for f in STORIES_DIR.iterdir():
        shutil.copy(f, path / f.name)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return stories_with_chat_template(tmp_path_factory.mktemp("stories_chat"))


@contextlib.contextmanager
def running_server(model: Path, args: list[str], log_path: Path, env: dict,
                   new_session: bool = False):
    """`kiln serve model *args` on a free loopback port, once /health answers: (url, process);
    killed on exit if still running (its whole group, with `new_session`: a process group of its
    own). Its output goes to log_path (a file: nobody drains a pipe while tests run)."""
    port = free_port()
    cmd = [sys.executable, "-m", "kiln.entrypoints.cli.main", "serve", str(model),
           "--port", str(port), "--served-model-name", NAME, *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=new_session)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"kiln serve exited early:\n{log_path.read_text()}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            proc.kill()
            pytest.fail("kiln serve did not become healthy in 120 s")
        try:
            yield url, proc
        finally:
            if new_session:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(stories_chat_server):
    """(url, process): the package's stories server (tests/server/conftest.py), shared with
    test_responses_server; the last test here stops it."""
    return stories_chat_server()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def reference(model_dir):
    """LLM.generate's greedy outputs for PROMPTS (in-process, eager)."""
    from kiln import LLM, SamplingParams

    llm = LLM(model=str(model_dir), enforce_eager=True, max_model_len=512,
              kv_cache_memory=0.05)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    return [o.outputs[0].text for o in outs]


AUTH = {"Authorization": f"Bearer {KEY}"}  # every route but /health needs it


def metric_samples(url: str) -> dict:
    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    out: dict = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + (f"[{s.labels['finished_reason']}]"
                            if "finished_reason" in s.labels else "")
            out[key] = out.get(key, 0.0) + s.value
    return out


def test_completions_match_llm_generate(client, reference):
    for prompt, expected in zip(PROMPTS, reference):
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == expected
        assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens > 0
        stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=24,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
        assert chunks[-1].usage.completion_tokens == 24


def test_completion_n_stop_logprobs(client, reference):
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=16, n=2,
                                  temperature=1.0, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1] and all(c.text for c in r.choices)
    assert r.usage.completion_tokens == 32
    stop_word = reference[0].split()[4]
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                  stop=[stop_word])
    assert r.choices[0].finish_reason == "stop" and stop_word not in r.choices[0].text
    assert reference[0].startswith(r.choices[0].text)
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == reference[0][:len(r.choices[0].text)]
    # Token strings are the engine's per-token decode (a SentencePiece tokenizer drops the
    # leading space), so compare without spaces.
    assert "".join(lp.tokens).replace(" ", "") == r.choices[0].text.replace(" ", "")
    assert len(lp.token_logprobs) == 8 and all(x <= 0 for x in lp.token_logprobs)
    for tok, top, best in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs):
        assert tok in top and max(top.values()) == pytest.approx(best)  # greedy = top-1


def test_completion_echo_logprobs_scores_the_prompt(client):
    plain = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=4,
                                      temperature=0, logprobs=2)
    r = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=4, temperature=0,
                                  logprobs=2, echo=True)
    lp, n_prompt = r.choices[0].logprobs, r.usage.prompt_tokens
    assert r.choices[0].text == PROMPTS[2] + plain.choices[0].text
    assert len(lp.tokens) == n_prompt + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(top) >= 2 for top in lp.top_logprobs[1:n_prompt])
    assert lp.token_logprobs[n_prompt:] == pytest.approx(plain.choices[0].logprobs.token_logprobs,
                                                         abs=1e-4)
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=4,
                                            temperature=0, logprobs=2, echo=True, stream=True))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs
                for x in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
    # max_tokens 0 (the openai SDK passes it through): the same prompt scores, nothing else.
    only = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=0, logprobs=2,
                                     echo=True)
    assert only.choices[0].text == PROMPTS[2] and only.choices[0].finish_reason == "length"
    assert only.usage.completion_tokens == 0
    assert only.choices[0].logprobs.tokens == lp.tokens[:n_prompt]
    assert only.choices[0].logprobs.token_logprobs[1:] == \
        pytest.approx(lp.token_logprobs[1:n_prompt], abs=1e-4)


def test_chat_whole_streamed_n_logprobs(client, server):
    messages = [{"role": "user", "content": "Tell me a story."}]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=16,
                                       temperature=0, logprobs=True, top_logprobs=2)
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and text
    content = r.choices[0].logprobs.content
    assert len(content) == 16 and all(len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content).replace(" ", "") == text.replace(" ", "")
    # The chat prompt is the rendered template: completing its token ids gives the same text.
    ids = httpx.post(f"{server[0]}/tokenize", json={"messages": messages},
                     headers=AUTH).json()["tokens"]
    same = client.completions.create(model=NAME, prompt=ids, max_tokens=16, temperature=0)
    assert same.choices[0].text == text
    # Message content is data: template syntax inside it is not evaluated.
    ids = httpx.post(f"{server[0]}/tokenize", headers=AUTH, json={
        "messages": [{"role": "user", "content": "{{ 7 * 7 }}"}]}).json()["tokens"]
    rendered = httpx.post(f"{server[0]}/detokenize", json={"tokens": ids},
                          headers=AUTH).json()["prompt"]
    assert "user: {{ 7 * 7 }}" in rendered and "49" not in rendered
    # A long list decodes off the event loop, its range check there too.
    many = httpx.post(f"{server[0]}/detokenize", json={"tokens": ids * 500}, headers=AUTH)
    assert many.status_code == 200 and many.json()["prompt"].count("{{ 7 * 7 }}") == 500
    bad = httpx.post(f"{server[0]}/detokenize", json={"tokens": ids * 500 + [10**6]},
                     headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=16,
                                                 temperature=0, stream=True, n=2))
    for i in (0, 1):
        streamed = "".join(ch.delta.content or "" for c in chunks for ch in c.choices
                           if ch.index == i)
        assert streamed == text  # greedy: both samples equal the unstreamed one
    assert chunks[0].choices[0].delta.role == "assistant"


def test_64_concurrent_streams_match_solo_runs(server, client, reference):
    url = server[0]
    solo = {}
    for p in PROMPTS:  # one at a time: the tokens each prompt gets alone
        r = client.completions.create(model=NAME, prompt=p, max_tokens=24, temperature=0,
                                      logprobs=0)
        solo[p] = r.choices[0].logprobs.tokens
        assert r.choices[0].text == reference[PROMPTS.index(p)]

    async def main():
        aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)

        async def one(prompt):
            stream = await aclient.completions.create(model=NAME, prompt=prompt, max_tokens=24,
                                                      temperature=0, stream=True, logprobs=0)
            tokens, texts = [], []
            async for chunk in stream:
                for c in chunk.choices:
                    texts.append(c.text)
                    if c.logprobs is not None:
                        tokens.extend(c.logprobs.tokens)
            return prompt, tokens, "".join(texts)

        try:
            return await asyncio.gather(*(one(PROMPTS[i % len(PROMPTS)]) for i in range(64)))
        finally:
            await aclient.close()

    results = asyncio.run(main())
    assert len(results) == 64
    for prompt, tokens, text in results:
        assert text == reference[PROMPTS.index(prompt)]
        assert tokens == solo[prompt]  # each token once, in order


def _wait_for_abort(url: str, before: dict) -> dict:
    key = "kiln:request_success_total[abort]"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        after = metric_samples(url)
        if after.get(key, 0) > before.get(key, 0) and after["kiln:num_requests_running"] == 0:
            return after
        time.sleep(0.05)
    pytest.fail("the disconnected request was not aborted within 20 s")


def test_disconnect_aborts_and_frees_blocks(server):
    url = server[0]
    headers = {"Authorization": f"Bearer {KEY}"}
    before = metric_samples(url)
    free0 = before["kiln:kv_cache_free_blocks"]
    body = dict(model=NAME, prompt=PROMPTS[2], max_tokens=480, temperature=0, ignore_eos=True,
                stream=True)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                break  # leave the block: the connection closes mid-stream
    after = _wait_for_abort(url, before)
    assert after["kiln:kv_cache_free_blocks"] == free0
    assert after["kiln:generation_tokens_total"] - before["kiln:generation_tokens_total"] < 480
    # A non-streaming client that gives up is noticed too.
    before = after
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, headers=headers,
                   timeout=0.3)
    after = _wait_for_abort(url, before)
    assert after["kiln:kv_cache_free_blocks"] == free0


def test_bench_serve_against_live_server(server):
    from kiln.benchmarks.serve import run_benchmark

    report = asyncio.run(run_benchmark(server[0], num_prompts=8, input_len=8, output_len=8,
                                       request_rate=math.inf, max_concurrency=4, api_key=KEY))
    assert report["completed"] == 8 and report["failed"] == 0, report
    assert report["total_output_tokens"] == 64 and report["output_tokens_per_s"] > 0
    assert set(report["ttft_ms"]) == {"p50", "p90", "p99", "mean"}
    assert 0 < report["itl_ms"]["p50"] <= report["itl_ms"]["p99"]


def _error(e) -> dict:
    return e.value.response.json()["error"]


def test_bad_inputs_and_server_keeps_serving(client, server):
    url = server[0]
    bad = openai.BadRequestError
    with pytest.raises(openai.NotFoundError) as e:  # as OpenAI and vLLM: 404 model_not_found
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert _error(e)["param"] == "model" and _error(e)["code"] == "model_not_found"
    with pytest.raises(bad) as e:
        client.completions.create(model=NAME, prompt="a " * 600, max_tokens=1)
    assert _error(e)["param"] == "prompt" and _error(e)["code"] == "context_length_exceeded"
    with pytest.raises(bad) as e:
        client.completions.create(model=NAME, prompt="x", temperature=-1)
    assert _error(e)["param"] == "temperature"
    with pytest.raises(bad) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}],
                                       logprobs=True, top_logprobs=50)
    assert _error(e)["param"] == "top_logprobs"
    with pytest.raises(bad) as e:
        client.completions.create(model=NAME, prompt="x", extra_body={"top_k": "many"})
    assert _error(e)["param"] == "top_k"
    auth = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    r = httpx.post(f"{url}/v1/completions", content=b"{not json", headers=auth)
    assert r.status_code == 400 and r.json()["error"]["code"] == "json_invalid"
    r = httpx.post(f"{url}/v1/completions", content=b"[" + b"1," * 150_000 + b"1]",
                   headers=auth)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.completions.create(model=NAME, prompt="x", max_tokens=2).choices[0].text


def test_metrics_parse_and_counters_move(client, server):
    before = metric_samples(server[0])
    client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=5, temperature=0)
    after = metric_samples(server[0])
    assert after["kiln:generation_tokens_total"] - before["kiln:generation_tokens_total"] == 5
    assert after["kiln:prompt_tokens_total"] > before["kiln:prompt_tokens_total"]
    assert after["kiln:time_to_first_token_seconds_count"] == \
        before["kiln:time_to_first_token_seconds_count"] + 1
    assert after["kiln:inter_token_latency_seconds_count"] >= \
        before["kiln:inter_token_latency_seconds_count"] + 4
    assert after["kiln:kv_cache_usage_perc"] == 0 and after["kiln:num_requests_waiting"] == 0


def test_sigterm_mid_request_exits_cleanly(server):
    url, proc = server
    result = {}

    def long_request():
        body = dict(model=NAME, prompt="x", max_tokens=480, ignore_eos=True, stream=True)
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30,
                              headers={"Authorization": f"Bearer {KEY}"}) as r:
                result["lines"] = [line for line in r.iter_lines() if line]
        except httpx.HTTPError as e:
            result["error"] = e

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    t.join(timeout=30)
    # The stream always ends in-band with [DONE]: finished within the 0.5 s grace period, or
    # aborted after it as vLLM's shutdown ends a request, finish_reason "abort" (test_soak_server
    # pins the latter down); the process exits with 0 either way.
    assert "error" not in result, result
    assert result["lines"][-1] == "data: [DONE]", result["lines"][-2:]
    last = json.loads(result["lines"][-2][len("data: "):])
    assert last["choices"][0]["finish_reason"] in ("length", "abort"), last
