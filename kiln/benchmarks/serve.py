"""Online serving benchmark: streaming clients on loopback, Poisson arrivals, latency percentiles.

Prompts are seeded random token ids of exactly `input_len` tokens; every request generates
exactly `output_len` tokens (ignore_eos), so runs are comparable across engines and flags.
"""
import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

import aiohttp

from kiln.benchmarks.vllm_fields import percentile, serve_fields


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0  # seconds from send to the first token
    itls: list[float] = field(default_factory=list)  # gaps between token-bearing chunks
    # to the last token-bearing chunk, as vllm bench's latency (its e2el, and TPOT from it):
    # the usage chunk and [DONE] after it do not move it
    latency: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


def random_token_prompts(num: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the first ids (specials in most vocabularies).
    low = min(3, vocab_size - 1)
    return [[rng.randrange(low, vocab_size) for _ in range(input_len)] for _ in range(num)]


def check_request_rate(rate: float) -> None:
    if not (rate == math.inf or 0 < rate < math.inf):  # NaN and -inf too
        raise ValueError(f"--request-rate must be > 0 requests/s (or inf: all at once), got "
                         f"{rate}")


def arrival_delays(num: int, rate: float, seed: int) -> list[float]:
    """Gaps between sends: exponential (Poisson process) at `rate`/s; all zero for inf."""
    check_request_rate(rate)
    if rate == math.inf:
        return [0.0] * num
    rng = random.Random(seed + 1)
    return [rng.expovariate(rate) for _ in range(num)]


def send_offsets(delays: list[float]) -> list[float]:
    """Seconds after the start at which each request is sent: the first at once, then one gap
    after another (as vLLM's benchmark sends), not a gap before the first."""
    offsets, t = [], 0.0
    for gap in delays:
        offsets.append(t)
        t += gap
    return offsets


def percentiles(values: list[float], qs=(50, 90, 99)) -> dict[str, float]:
    """Linear-interpolated percentiles in milliseconds (NaN-free: 0 for no data)."""
    data = sorted(values)
    out = {f"p{q}": round(percentile(data, q) * 1000, 3) for q in qs}
    out["mean"] = round(sum(data) / len(data) * 1000, 3) if data else 0.0
    return out


async def _one_request(session: aiohttp.ClientSession, url: str, model: str,
                       prompt: list[int], output_len: int, headers: dict) -> RequestResult:
    body = dict(model=model, prompt=prompt, max_tokens=output_len, temperature=0,
                ignore_eos=True, stream=True, stream_options={"include_usage": True})
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last = None
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error")
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    # the ids sent, where a server's usage leaves the count out
                    result.prompt_tokens = chunk["usage"].get("prompt_tokens", len(prompt))
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
        result.ok = last is not None
        result.latency = last - start if result.ok else time.perf_counter() - start
        if not result.ok:
            result.error = "no tokens received"
    except (TimeoutError, aiohttp.ClientError) as e:
        result.error = f"{type(e).__name__}: {e}"
    except (ValueError, KeyError, TypeError) as e:  # a chunk that is not the API's JSON
        result.error = f"bad stream chunk: {type(e).__name__}: {e}"
    return result


async def _served_model(session: aiohttp.ClientSession, base_url: str, headers: dict,
                        model: str | None) -> str:
    """The model to ask for: `model` if the server serves it, else the server's first."""
    try:
        async with session.get(f"{base_url}/v1/models", headers=headers) as r:
            if r.status != 200:
                raise ValueError(f"{base_url}/v1/models answered HTTP {r.status}: "
                                 f"{(await r.text())[:200]}" +
                                 ("; pass the server's key with --api-key"
                                  if r.status == 401 else ""))
            served = [m["id"] for m in (await r.json())["data"]]
    except aiohttp.ClientError as e:
        raise ValueError(f"cannot reach the server at {base_url} ({type(e).__name__}: {e}); "
                         "start `kiln serve` there or fix --base-url") from None
    if not served:
        raise ValueError(f"{base_url}/v1/models lists no model")
    if model is None:
        return served[0]
    if model not in served:
        raise ValueError(f"the server at {base_url} does not serve model {model!r}; it serves "
                         f"{served}: pass one of those as --model")
    return model


async def run_benchmark(base_url: str, num_prompts: int, input_len: int, output_len: int,
                        request_rate: float, max_concurrency: int | None, seed: int = 0,
                        api_key: str | None = None, vocab_size: int | None = None,
                        model: str | None = None) -> dict:
    """`model`: the served name to ask for (default: the server's first)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base_url = base_url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = await _served_model(session, base_url, headers, model)
        vocab = vocab_size or await _vocab_size(session, base_url, headers)
        prompts = random_token_prompts(num_prompts, input_len, vocab, seed)
        delays = arrival_delays(num_prompts, request_rate, seed)
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        url = f"{base_url}/v1/completions"

        async def limited(prompt):
            if gate is None:
                return await _one_request(session, url, model, prompt, output_len, headers)
            async with gate:
                return await _one_request(session, url, model, prompt, output_len, headers)

        start = time.perf_counter()
        tasks = []
        # Sleep to each absolute send time, so the sleeps' overshoot does not add up.
        for prompt, offset in zip(prompts, send_offsets(delays)):
            wait = start + offset - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(limited(prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, dict(
        num_prompts=num_prompts, input_len=input_len, output_len=output_len,
        request_rate=request_rate if not math.isinf(request_rate) else "inf",
        max_concurrency=max_concurrency, model=model, base_url=base_url))


async def _vocab_size(session, base_url: str, headers: dict) -> int:
    """One past the largest id /detokenize accepts, by bisection (OpenAI has no vocab field)."""
    async with session.post(f"{base_url}/detokenize", json={"tokens": [0]},
                            headers=headers) as r:
        if r.status != 200:
            raise ValueError(f"{base_url}/detokenize answered HTTP {r.status}; pass --vocab-size")
    good, bad = 0, 1 << 22  # an id known to decode, and one assumed not to
    while bad - good > 1:
        mid = (good + bad) // 2
        async with session.post(f"{base_url}/detokenize", json={"tokens": [mid]},
                                headers=headers) as r:
            if r.status == 200:
                good = mid
            else:
                bad = mid
    return bad


def summarize(results: list[RequestResult], duration: float, config: dict) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    errors = sorted({r.error for r in results if not r.ok})
    return {
        **config,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors[:5],
        "duration_s": round(duration, 3),
        "requests_per_s": round(len(ok) / duration, 3) if duration else 0.0,
        "output_tokens_per_s": round(out_tokens / duration, 3) if duration else 0.0,
        "total_output_tokens": out_tokens,
        "ttft_ms": percentiles([r.ttft for r in ok]),
        "itl_ms": percentiles([g for r in ok for g in r.itls]),
        "e2e_latency_ms": percentiles([r.latency for r in ok]),
        **serve_fields(ok, duration),  # the same figures (and TPOT) under vllm bench's names
    }
