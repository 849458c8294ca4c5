"""`kiln bench serve`'s client against a scripted SSE server (aiohttp, loopback): model choice,
clear errors for an unreachable server or an unserved model, TTFT / ITL from chunk arrival
times, failures counted but kept out of latency stats, the API key sent on every call."""
import asyncio
import json

import pytest
from aiohttp import web

from kiln.benchmarks.serve import arrival_delays, run_benchmark, send_offsets
from kiln.executor.free_port import free_port

KEY = "sekrit"


def make_app(gap: float, fail_every: int = 0, tail: float = 0.0) -> web.Application:
    """Streams output_len one-token chunks `gap` s apart, then the usage chunk `tail` s later;
    every `fail_every`-th request breaks."""
    seen = {"n": 0}

    def authed(request):
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            raise web.HTTPUnauthorized(text="bad key")

    async def models(request):
        authed(request)
        return web.json_response({"object": "list", "data": [{"id": "m1"}, {"id": "m2"}]})

    async def detokenize(request):
        authed(request)
        ids = (await request.json())["tokens"]
        return web.json_response({"prompt": "x"}, status=200 if max(ids) < 50 else 400)

    async def completions(request):
        authed(request)
        body = await request.json()
        seen["n"] += 1
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        if fail_every and seen["n"] % fail_every == 0:
            await resp.write(b"data: {not json\n\n")
            return resp
        for k in range(body["max_tokens"]):
            await asyncio.sleep(gap)
            chunk = {"model": body["model"], "choices": [{"index": 0, "text": f"t{k}"}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        await asyncio.sleep(tail)
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_post("/v1/completions", completions)
    return app


def bench(gap=0.02, fail_every=0, tail=0.0, **kw):
    async def go():
        port = free_port()
        runner = web.AppRunner(make_app(gap, fail_every, tail))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            args = dict(num_prompts=4, input_len=3, output_len=4, request_rate=float("inf"),
                        max_concurrency=None, api_key=KEY)
            args.update(kw)
            return await run_benchmark(f"http://127.0.0.1:{port}", **args)
        finally:
            await runner.cleanup()
    return asyncio.run(go())


def test_latencies_from_chunk_arrival_and_vocab_probe_with_key():
    r = bench(gap=0.03, model="m2")
    assert r["model"] == "m2" and (r["completed"], r["failed"]) == (4, 0)
    assert r["total_output_tokens"] == 16
    # this server's usage has no prompt_tokens: the ids sent are counted (vLLM's field)
    assert r["total_input_tokens"] == 12 and 25 <= r["median_tpot_ms"] < 200
    # First chunk after one gap, then one gap per chunk: 3 ITLs per request of 4 tokens.
    assert 25 <= r["ttft_ms"]["p50"] < 200
    assert 25 <= r["itl_ms"]["p50"] < 200
    assert r["e2e_latency_ms"]["p50"] >= 4 * 25


def test_latency_ends_at_the_last_token():
    """vllm bench's latency (e2el, and TPOT from it) ends at the last token-bearing chunk; the
    usage chunk after it carries no token. Kiln's ran to the stream's end: a usage chunk 0.6 s
    late made TPOT (4 tokens 30 ms apart) 0.2 s."""
    r = bench(gap=0.03, tail=0.6, vocab_size=50)
    assert r["completed"] == 4
    assert 25 <= r["median_tpot_ms"] < 150 and r["median_e2el_ms"] < 450
    assert r["e2e_latency_ms"]["p50"] < 450


def test_default_model_is_the_servers_first():
    assert bench(vocab_size=50)["model"] == "m1"


def test_failed_requests_are_counted_and_kept_out_of_latencies():
    r = bench(gap=0.01, fail_every=2, vocab_size=50)
    assert (r["completed"], r["failed"]) == (2, 2)
    assert r["errors"] and r["errors"][0].startswith("bad stream chunk")
    assert r["total_output_tokens"] == 8


def test_unserved_model_is_a_clear_error():
    with pytest.raises(ValueError, match=r"does not serve model 'nope'.*'m1', 'm2'"):
        bench(model="nope")


def test_wrong_key_is_a_clear_error():
    with pytest.raises(ValueError, match="HTTP 401.*--api-key"):
        bench(api_key="wrong")


def test_unreachable_server_is_a_clear_error():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match="cannot reach the server"):
        asyncio.run(run_benchmark(url, 1, 3, 2, float("inf"), None, vocab_size=50))


def test_first_request_goes_at_once_then_poisson_gaps():
    gaps = arrival_delays(5, 4.0, seed=3)
    offsets = send_offsets(gaps)
    assert offsets[0] == 0.0
    assert offsets[1:] == pytest.approx([sum(gaps[:i]) for i in range(1, 5)])
    assert send_offsets(arrival_delays(3, float("inf"), 0)) == [0.0, 0.0, 0.0]
