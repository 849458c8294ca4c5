"""The stall probe's front-end load, in a process of its own: huge bodies, idle and churning
connections. Apart from the probe's stream, so the stream's clock never waits on this work.

`python -m kiln.benchmarks.stall_load` reads {base_url, headers, model, load, duration} as one
JSON line on stdin, builds its bodies, prints `ready`, and starts on the next line of stdin; then
it prints {intervals, opened, churned, held_until} (time.monotonic(): one clock machine-wide;
held_until: the load's end, before its idle connections all hang up). The handshake keeps the
interpreter's start-up (imports, 8 MB of bodies: CPU on the server's cores) out of the phase.
"""
import asyncio
import json
import os
import sys
import time

import aiohttp


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


async def _idle_connections(host: str, port: int, n: int, writers: list,
                            stop: asyncio.Event) -> None:
    """Open `n` connections into `writers`, 50 at a time every 50 ms (one by one, under the
    rest of the load, 1,000 took longer than the probe; all at once, their accepts held the
    server's event loop), and hold them (the caller closes them)."""
    async def one() -> None:
        try:
            writers.append((await asyncio.open_connection(host, port))[1])
        except OSError:
            pass  # out of file descriptors: hold what we have

    for start in range(0, n, 50):
        if stop.is_set():
            return
        await asyncio.gather(*(one() for _ in range(min(50, n - start))))
        await asyncio.sleep(0.05)


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
    if kind == "ids":  # ", 123" is 5 bytes an id
        ids = [100 + i % 900 for i in range(max(1, size // 5))]
        return json.dumps({"model": model, "prompt": ids, "max_tokens": 4}).encode()
    return json.dumps({"model": model, "prompt": filler, "max_tokens": 4}).encode()


def build_bodies(model: str, load: dict) -> dict[str, bytes]:
    """The big requests' bodies, by kind (`load`: LoadSpec's fields)."""
    bodies = {"tokenize": _body("tokenize", model, load["tokenize_bytes"]),
              "prompt": _body("prompt", model, load["prompt_400_bytes"])}
    if load["id_prompt_400_clients"]:  # off by default: no 4 MB body built for nothing
        bodies["ids"] = _body("ids", model, load["prompt_400_bytes"])
    return bodies


async def run_load(base_url: str, headers: dict, model: str, load: dict, duration: float,
                   bodies: dict[str, bytes]) -> dict:
    """`load`: LoadSpec's fields; `bodies`: build_bodies'. Runs every kind of load for
    `duration` s, then lets the big requests in flight finish (their errors surface)."""
    host, port = base_url.split("://", 1)[1].rsplit(":", 1)
    port = int(port.rstrip("/"))
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    stop = asyncio.Event()
    intervals: list[tuple[float, float]] = []
    idle: list = []  # the idle connections' writers
    churned = [0]
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = [asyncio.create_task(_big_posts(session, f"{base_url}/tokenize", headers,
                                                bodies["tokenize"], 200, intervals, stop))
                 for _ in range(load["tokenize_clients"])]
        tasks += [asyncio.create_task(_big_posts(session, f"{base_url}/v1/completions",
                                                 headers, bodies["prompt"], 400, intervals,
                                                 stop))
                  for _ in range(load["prompt_400_clients"])]
        tasks += [asyncio.create_task(_big_posts(session, f"{base_url}/v1/completions",
                                                 headers, bodies["ids"], 400, intervals, stop))
                  for _ in range(load["id_prompt_400_clients"])]
        tasks.append(asyncio.create_task(_idle_connections(host, port, load["idle_connections"],
                                                           idle, stop)))
        tasks += [asyncio.create_task(_churn(host, port, churned, stop))
                  for _ in range(load["churn_clients"])]
        try:
            await asyncio.sleep(duration)
            stop.set()
            await asyncio.gather(*tasks)
            held_until = time.monotonic()
        finally:
            # The idle connections all drop at once: a disconnect storm, timed apart.
            for w in idle:
                w.close()
            await asyncio.sleep(0.5)  # the server sees the hang-ups while the stream runs
    return {"intervals": intervals, "opened": len(idle), "churned": churned[0],
            "held_until": held_until}


def lower_priority(niceness: int) -> int | None:
    """Add `niceness` to this process's (see LoadSpec.niceness); the niceness it then runs at,
    None where the OS has none."""
    try:
        return os.nice(niceness)
    except (AttributeError, OSError):
        return None


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    niceness = lower_priority(spec["load"].get("niceness", 0))
    bodies = build_bodies(spec["model"], spec["load"])
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        sys.exit("stall_load: expected `go` on stdin after `ready`")
    print(json.dumps({**asyncio.run(run_load(**spec, bodies=bodies)), "niceness": niceness}),
          flush=True)


if __name__ == "__main__":
    main()
