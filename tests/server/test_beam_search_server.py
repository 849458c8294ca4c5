"""use_beam_search=true on the server, on a real tiny engine: n beams equal HF's num_beams,
fields the search would ignore are refused naming them, and requests running beside a search
get the answer they get alone."""
import threading

import pytest
import torch
from fastapi.testclient import TestClient

from kiln.engine.arg_utils import EngineArgs
from kiln.engine.async_llm import AsyncLLM
from kiln.engine.llm_engine import LLMEngine
from kiln.entrypoints.openai.api_server import ServerSettings, build_app

from checkpoints import random_prompts

# The engine core in this process: what is tested is the engine, not its process (a core
# process costs an interpreter start per engine; test_core_process.py covers that one).
pytestmark = pytest.mark.usefixtures("inprocess_core")

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def client(tiny_llama_dir):
    args = EngineArgs(model=str(tiny_llama_dir), enforce_eager=True, max_model_len=64,
                      block_size=4, chat_template="{% for m in messages %}w4 {{ m['content'] }}"
                      " {% endfor %}w3")
    llm = AsyncLLM(LLMEngine(args.create_kiln_config()))
    app = build_app(llm, ServerSettings(served_model_names=["m"]))
    with TestClient(app) as c:
        yield c


def hf_beams(model_dir, prompt: list[int], k: int, max_new: int, length_penalty=1.0):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, num_beams=k,
                             num_return_sequences=k, max_new_tokens=max_new, pad_token_id=0,
                             length_penalty=length_penalty)
    return [row[len(prompt):] for row in out.tolist()]


@pytest.mark.parametrize("n", [2, 4])
def test_completion_beams_equal_hf(client, tiny_llama_dir, n):
    prompts = random_prompts(2, [5, 8], seed=n)
    r = client.post(CMPL, json=dict(prompt=prompts, use_beam_search=True, n=n, max_tokens=6,
                                    temperature=0, ignore_eos=True, return_token_ids=True,
                                    length_penalty=1.5))
    assert r.status_code == 200, r.json()
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(2 * n))
    for i, p in enumerate(prompts):
        got = [c["token_ids"] for c in choices[i * n:(i + 1) * n]]
        assert got == hf_beams(tiny_llama_dir, p, n, 6, 1.5)
        assert all(c["finish_reason"] == "length" for c in choices[i * n:(i + 1) * n])
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == 2 * n * 6
    assert usage["prompt_tokens"] == 13


@pytest.mark.parametrize("path, body", [
    (CMPL, dict(prompt="w5 w6", echo=True)),
    (CHAT, dict(messages=[{"role": "user", "content": "w5 w6"}])),
])
def test_one_beam_answers_as_greedy_sampling(client, path, body):
    # the same tokens, the same text: a word's leading space after the prompt kept
    body = dict(body, max_tokens=6, temperature=0, ignore_eos=True, return_token_ids=True)
    greedy = client.post(path, json=body).json()["choices"]
    beam = client.post(path, json=dict(body, use_beam_search=True)).json()["choices"]
    assert beam == greedy


def test_chat_beams(client):
    r = client.post(CHAT, json=dict(messages=[{"role": "user", "content": "w5 w6"}],
                                    use_beam_search=True, n=3, max_tokens=4, temperature=0))
    assert r.status_code == 200, r.json()
    choices = r.json()["choices"]
    assert len(choices) == 3 and len({c["message"]["content"] for c in choices}) == 3
    assert r.json()["usage"]["completion_tokens"] <= 12


# field the message opens with, the param (the switch it conflicts with, or itself)
BEAM = "use_beam_search"


@pytest.mark.parametrize("path, extra, named, param", [
    (CMPL, dict(stream=True), "stream", BEAM),
    (CMPL, dict(logprobs=2), "logprobs", BEAM),
    (CHAT, dict(logprobs=True), "logprobs", BEAM),
    (CMPL, dict(top_p=0.5), "top_p", BEAM),
    (CMPL, dict(stop=["w9"]), "stop", BEAM),
    (CMPL, dict(seed=3), "seed", BEAM),
    (CMPL, dict(min_tokens=2), "min_tokens", BEAM),
    # repetition detection ends no beam: refused rather than ignored (vLLM ignores it)
    (CMPL, dict(max_repetition_pattern_size=2, repetition_min_count=2),
     "max_repetition_pattern_size", BEAM),
    (CHAT, dict(max_repetition_pattern_size=2, repetition_min_count=2),
     "max_repetition_pattern_size", BEAM),
    (CHAT, dict(repetition_detection={"max_pattern_size": 2, "min_count": 2}),
     "repetition_detection", BEAM),
    (CHAT, dict(response_format={"type": "json_object"}), "response_format", BEAM),
    (CMPL, dict(n=11), "n=11", "n"),  # 22 logprobs a step: past --max-logprobs 20
    (CMPL, dict(max_tokens=100), "max_tokens", "max_tokens"),  # past max_model_len
    (CHAT, dict(max_completion_tokens=100), "max_completion_tokens", "max_completion_tokens"),
])
def test_refused_naming_the_field(client, path, extra, named, param):
    body = dict(prompt="w5 w6", max_tokens=3) if path == CMPL else dict(
        messages=[{"role": "user", "content": "w5"}], max_tokens=3)
    r = client.post(path, json={**body, "use_beam_search": True, "n": 2, **extra})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param, error
    assert error["message"].startswith(named), error
    assert "beam_width" not in error["message"]  # the request calls it n


@pytest.mark.parametrize("value", ["NaN", "Infinity"])
def test_a_length_penalty_that_is_no_number_is_refused(client, value):
    # JSON's NaN / Infinity passed the field's type and failed the search's own check: a 500
    body = '{"prompt": "w5", "max_tokens": 2, "use_beam_search": true, "n": 2, ' \
           f'"length_penalty": {value}}}'
    r = client.post(CMPL, content=body, headers={"Content-Type": "application/json"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "length_penalty", error


def test_length_penalty_without_beam_search_is_refused(client):
    r = client.post(CMPL, json=dict(prompt="w5", max_tokens=2, length_penalty=0.5))
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == BEAM
    assert error["message"].startswith("length_penalty=0.5")


def test_other_requests_are_undisturbed_by_a_search(client):
    greedy = dict(prompt="w7 w8 w9", max_tokens=12, temperature=0, ignore_eos=True)
    alone = client.post(CMPL, json=greedy).json()["choices"][0]["text"]
    results, errors = [], []

    def search():
        try:
            r = client.post(CMPL, json=dict(prompt="w5 w6", use_beam_search=True, n=4,
                                            max_tokens=20, temperature=0, ignore_eos=True))
            results.append(r.status_code)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=search) for _ in range(2)]
    for t in threads:
        t.start()
    beside = [client.post(CMPL, json=greedy).json()["choices"][0]["text"] for _ in range(3)]
    for t in threads:
        t.join()
    assert not errors and results == [200, 200]
    assert beside == [alone] * 3
    stats = client.get("/metrics").text
    assert "kiln:num_requests_running" in stats


def test_truncate_prompt_tokens_applies(client):
    # the prompt's last 5 tokens, as sampling reads them: the beams of the cut prompt
    long = " ".join(f"w{5 + i % 90}" for i in range(80))  # past max_model_len 64
    tail = " ".join(long.split()[-5:])
    body = dict(use_beam_search=True, n=2, max_tokens=4, temperature=0, ignore_eos=True,
                return_token_ids=True)
    cut = client.post(CMPL, json=dict(body, prompt=long, truncate_prompt_tokens=5))
    assert cut.status_code == 200, cut.json()
    whole = client.post(CMPL, json=dict(body, prompt=tail)).json()
    assert [c["token_ids"] for c in cut.json()["choices"]] == \
        [c["token_ids"] for c in whole["choices"]]
    assert cut.json()["usage"]["prompt_tokens"] == 5


def test_a_client_that_leaves_stops_the_search(tiny_llama_dir):
    import json
    import socket
    import time
    import urllib.request

    from .uvicorn_thread import uvicorn_in_thread

    args = EngineArgs(model=str(tiny_llama_dir), enforce_eager=True, max_model_len=256,
                      block_size=4)
    llm = AsyncLLM(LLMEngine(args.create_kiln_config()))
    app = build_app(llm, ServerSettings(served_model_names=["m"]))
    body = json.dumps(dict(prompt="w5 w6", use_beam_search=True, n=8, max_tokens=200,
                           ignore_eos=True)).encode()
    with uvicorn_in_thread(app) as port:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            time.sleep(1.0)  # some steps in
        idle_since, deadline = None, time.monotonic() + 20
        while time.monotonic() < deadline:  # idle, and it stays idle: no step follows
            # the server's own view (/metrics): the engine's core client is its step loop's
            # alone; asking it from this thread could take the loop's answers
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
                stats = {line.split("{")[0]: float(line.split()[-1])
                         for line in r.read().decode().splitlines()
                         if line.startswith(("kiln:num_requests_", "kiln:kv_cache_usage"))}
            idle = stats["kiln:num_requests_running"] == stats["kiln:num_requests_waiting"] \
                == stats["kiln:kv_cache_usage_perc"] == 0
            idle_since = (idle_since or time.monotonic()) if idle else None
            if idle_since is not None and time.monotonic() - idle_since > 1.5:
                break
            time.sleep(0.1)
        assert idle_since is not None and time.monotonic() - idle_since > 1.5, stats
