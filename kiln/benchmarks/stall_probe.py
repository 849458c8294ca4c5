"""Stall probe: does front-end load (huge bodies, idle and churning connections) stall a stream?

One steady stream runs alone, then beside the load; the report compares its largest gap between
tokens in the two phases and counts the tokens that arrived while a big request was in flight.
"""
import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

from kiln.benchmarks.serve import _served_model, percentiles


@dataclass
class LoadSpec:
    """What the front end is loaded with (the issue's numbers by default)."""
    tokenize_bytes: int = 4_000_000  # a /tokenize body of this size, in a loop per client
    tokenize_clients: int = 1
    prompt_400_bytes: int = 4_000_000  # a completions prompt too long for the model: a 400
    prompt_400_clients: int = 1
    idle_connections: int = 1000  # opened and held, sending nothing
    churn_clients: int = 200  # each opens a connection and drops it, in a loop


@dataclass
class StreamRecord:
    """Arrival times of every token-bearing chunk, one list per streamed request."""
    requests: list[list[float]] = field(default_factory=list)

    def gaps(self, start: float, end: float) -> list[float]:
        return [b - a for times in self.requests for a, b in zip(times, times[1:])
                if start <= a and b <= end]

    def tokens_within(self, intervals: list[tuple[float, float]]) -> int:
        return sum(1 for times in self.requests for t in times
                   if any(s <= t <= e for s, e in intervals))


async def _stream(session, base_url: str, headers: dict, model: str, max_tokens: int,
                  record: StreamRecord, stop: asyncio.Event) -> None:
    """Back-to-back streamed completions until `stop`."""
    body = dict(model=model, prompt="Once upon a time", max_tokens=max_tokens, temperature=0,
                ignore_eos=True, stream=True)
    while not stop.is_set():
        times: list[float] = []
        record.requests.append(times)
        async with session.post(f"{base_url}/v1/completions", json=body,
                                headers=headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"the probe's stream got HTTP {resp.status}: "
                                   f"{(await resp.text())[:200]}")
            async for raw in resp.content:
                if raw.startswith(b"data: {"):
                    if b'"error"' in raw[:20]:
                        raise RuntimeError(f"the probe's stream failed: {raw[:300]!r}")
                    times.append(time.monotonic())
                if stop.is_set():
                    break


async def _big_posts(session, url: str, headers: dict, body: bytes, expect: int,
                     intervals: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        start = time.monotonic()
        async with session.post(url, data=body, headers={**headers, "content-type":
                                                         "application/json"}) as resp:
            await resp.read()
            if resp.status != expect:
                raise RuntimeError(f"{url} answered {resp.status}, expected {expect}")
        intervals.append((start, time.monotonic()))


async def _idle_connections(host: str, port: int, n: int, opened: list,
                            stop: asyncio.Event) -> None:
    writers = []
    try:
        for _ in range(n):
            try:
                _, w = await asyncio.open_connection(host, port)
            except OSError:
                break  # out of file descriptors: hold what we have
            writers.append(w)
        opened.append(len(writers))
        await stop.wait()
    finally:
        for w in writers:
            w.close()


async def _churn(host: str, port: int, counter: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            _, w = await asyncio.open_connection(host, port)
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and hang up mid-header
            w.close()
            counter[0] += 1
        except OSError:
            pass
        await asyncio.sleep(0.01)


def _body(kind: str, model: str, size: int) -> bytes:
    filler = "hello world, " * max(1, size // 13)
    if kind == "tokenize":
        return json.dumps({"model": model, "prompt": filler}).encode()
    return json.dumps({"model": model, "prompt": filler, "max_tokens": 4}).encode()


async def run_probe(base_url: str, duration: float = 5.0, load: LoadSpec | None = None,
                    api_key: str | None = None, model: str | None = None,
                    max_tokens: int = 64) -> dict:
    """Idle phase, then load phase, `duration` s each; a JSON-able report."""
    load = load or LoadSpec()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    host, port = base_url.split("://", 1)[1].rsplit(":", 1)
    port = int(port.rstrip("/"))
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = await _served_model(session, base_url, headers, model)
        record = StreamRecord()
        stop_stream = asyncio.Event()
        stream = asyncio.create_task(_stream(session, base_url, headers, model, max_tokens,
                                             record, stop_stream))
        idle_start = time.monotonic()
        await asyncio.sleep(duration)
        idle_end = load_start = time.monotonic()
        stop_load = asyncio.Event()
        intervals: list[tuple[float, float]] = []
        opened: list[int] = []
        churned = [0]
        tasks = [asyncio.create_task(_big_posts(
            session, f"{base_url}/tokenize", headers, _body("tokenize", model,
                                                            load.tokenize_bytes), 200,
            intervals, stop_load)) for _ in range(load.tokenize_clients)]
        tasks += [asyncio.create_task(_big_posts(
            session, f"{base_url}/v1/completions", headers, _body("prompt", model,
                                                                  load.prompt_400_bytes), 400,
            intervals, stop_load)) for _ in range(load.prompt_400_clients)]
        tasks.append(asyncio.create_task(_idle_connections(host, port, load.idle_connections,
                                                           opened, stop_load)))
        tasks += [asyncio.create_task(_churn(host, port, churned, stop_load))
                  for _ in range(load.churn_clients)]
        await asyncio.sleep(duration)
        stop_load.set()
        await asyncio.gather(*tasks)  # big requests in flight finish: their errors surface
        load_end = time.monotonic()
        stop_stream.set()
        await stream
    idle_gaps = record.gaps(idle_start, idle_end)
    loaded_gaps = record.gaps(load_start, load_end)
    idle_max = max(idle_gaps, default=0.0)
    loaded_max = max(loaded_gaps, default=0.0)
    return {
        "idle": {"tokens": len(idle_gaps), "max_gap_ms": round(idle_max * 1000, 3),
                 "gap_ms": percentiles(idle_gaps)},
        "loaded": {"tokens": len(loaded_gaps), "max_gap_ms": round(loaded_max * 1000, 3),
                   "gap_ms": percentiles(loaded_gaps)},
        "max_gap_ratio": round(loaded_max / idle_max, 3) if idle_max else None,
        "tokens_during_big_requests": record.tokens_within(intervals),
        "big_requests_done": len(intervals),
        "idle_connections_held": opened[0] if opened else 0,
        "connections_churned": churned[0],
        "load": load.__dict__, "duration_s": duration,
    }
