"""Stall probe: does front-end load (huge bodies, idle and churning connections) stall a stream?

One steady stream runs alone, then beside the load (stall_load.py, another process); the report
compares its largest gap between tokens in the two phases and counts the tokens that arrived
while a big request was in flight. The moment the load's 1,000 idle connections all hang up (a
disconnect storm) is reported on its own, as `teardown`.
"""
import asyncio
import contextlib
import dataclasses
import json
import sys
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
    # The same, as token ids (prompt_400_bytes of JSON): not in the load; a body whose
    # every item the front end once validated in Python on its event loop.
    id_prompt_400_clients: int = 0
    idle_connections: int = 1000  # opened and held, sending nothing
    churn_clients: int = 200  # each opens a connection and drops it, in a loop
    # Added to the load process's OS niceness (Unix; 0-19). 0: the load competes for the
    # server's cores as the probe did. At 19 (clients that yield the cores, as remote
    # ones would) it churns a fifth of the connections and finishes more big requests. Single
    # gaps of 100-370 ms at either setting, in either phase, were the VM's host pausing its
    # vCPUs (steal, or no ticks at all, in /proc/stat): hence rounds and their median.
    niceness: int = 0


@dataclass
class StreamRecord:
    """Arrival times of every token-bearing chunk, one list per streamed request."""
    requests: list[list[float]] = field(default_factory=list)

    def gaps(self, start: float, end: float) -> list[float]:
        """Gaps between consecutive tokens of the stream within [start, end], across its
        back-to-back requests too: a new request that waits is a stall the client sees."""
        return [gap for _, gap in self.gap_starts(start, end)]

    def gap_starts(self, start: float, end: float) -> list[tuple[float, float]]:
        """(when it began, gap) for each gap that `gaps` counts within [start, end]."""
        times = [t for request in self.requests for t in request]
        return [(a, b - a) for a, b in zip(times, times[1:]) if start <= a and b <= end]

    def gaps_within_requests(self, start: float, end: float) -> list[float]:
        """Gaps between consecutive tokens of one request within [start, end]: the stream's
        own pace, without the waits between its back-to-back requests (each new request's
        time to first token, which `gaps` counts too)."""
        return [b - a for times in self.requests for a, b in zip(times, times[1:])
                if start <= a and b <= end]

    def largest_gap_start(self, start: float, end: float) -> float | None:
        """When (seconds after `start`) the largest gap within [start, end] began."""
        pairs = [(gap, a) for a, gap in self.gap_starts(start, end)]
        return round(max(pairs)[1] - start, 3) if pairs else None

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


async def _start_load(base_url: str, headers: dict, model: str, load: LoadSpec,
                      duration: float) -> asyncio.subprocess.Process:
    """Start the load in its own interpreter (kiln/benchmarks/stall_load.py) and wait until it
    is ready: its start-up is not part of the load."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kiln.benchmarks.stall_load", stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE)
    spec = dict(base_url=base_url, headers=headers, model=model, load=dataclasses.asdict(load),
                duration=duration)
    proc.stdin.write(json.dumps(spec).encode() + b"\n")
    await proc.stdin.drain()
    if (await proc.stdout.readline()).strip() != b"ready":
        with contextlib.suppress(ProcessLookupError):  # an exit under way keeps its own code
            proc.kill()
        await proc.wait()
        raise RuntimeError(f"the probe's load process failed to start (exit "
                           f"{proc.returncode}); its error is above")
    return proc


async def _run_load(proc: asyncio.subprocess.Process) -> dict:
    """Let the ready load process go; its report once it is done."""
    out, _ = await proc.communicate(b"go\n")
    if proc.returncode != 0:
        raise RuntimeError(f"the probe's load process failed (exit {proc.returncode}); its "
                           "error is above")
    return json.loads(out)


@dataclass
class Phases:
    """One round's clock: its idle phase, then its load phase (time.monotonic())."""
    idle_start: float
    idle_end: float
    load_end: float
    loaded: dict  # stall_load's report

    @property
    def load_start(self) -> float:
        return self.idle_end


def round_report(record: StreamRecord, phases: Phases) -> dict:
    """The stream's gaps in one round: idle, loaded (until the load's idle connections hang
    up), and the hang-up itself (`teardown`)."""
    idle_start, idle_end, load_start = phases.idle_start, phases.idle_end, phases.load_start
    loaded = phases.loaded
    intervals = [tuple(i) for i in loaded["intervals"]]
    held_until = loaded["held_until"]
    idle_gaps = record.gaps(idle_start, idle_end)
    loaded_gaps = record.gaps(load_start, held_until)
    # the gap that spans the hang-ups counts here (it may begin before held_until)
    teardown_gaps = [g for a, g in record.gap_starts(load_start, phases.load_end)
                     if a + g > held_until]
    idle_max = max(idle_gaps, default=0.0)
    loaded_max = max(loaded_gaps, default=0.0)
    idle_within = max(record.gaps_within_requests(idle_start, idle_end), default=0.0)
    loaded_within = max(record.gaps_within_requests(load_start, held_until), default=0.0)
    teardown_max = max(teardown_gaps, default=0.0)
    return {
        "idle": {"tokens": len(idle_gaps), "max_gap_ms": round(idle_max * 1000, 3),
                 "max_gap_within_request_ms": round(idle_within * 1000, 3),
                 "max_gap_at_s": record.largest_gap_start(idle_start, idle_end),
                 "gap_ms": percentiles(idle_gaps)},
        "loaded": {"tokens": len(loaded_gaps), "max_gap_ms": round(loaded_max * 1000, 3),
                   "max_gap_within_request_ms": round(loaded_within * 1000, 3),
                   "max_gap_at_s": record.largest_gap_start(load_start, held_until),
                   "gap_ms": percentiles(loaded_gaps)},
        "teardown": {"connections": loaded["opened"], "max_gap_ms": round(teardown_max * 1000, 3),
                     "max_gap_ratio": round(teardown_max / idle_max, 3) if idle_max else None},
        "max_gap_ratio": round(loaded_max / idle_max, 3) if idle_max else None,
        "max_gap_within_request_ratio": (round(loaded_within / idle_within, 3)
                                         if idle_within else None),
        "tokens_during_big_requests": record.tokens_within(intervals),
        "big_requests_done": len(intervals),
        "idle_connections_held": loaded["opened"],
        "load_niceness": loaded["niceness"],
        "connections_churned": loaded["churned"],
    }


def median_round(ratios: list[float | None]) -> int:
    """Index of the round whose loaded/idle ratio is the median (the lower of the middle two
    for an even count; a round without a ratio, for want of idle tokens, counts as the
    worst): one pause of the whole machine, which both phases see at random, moves one
    round's ratio, not the report's."""
    if not ratios:
        raise ValueError("median_round: no rounds")
    order = sorted(range(len(ratios)),
                   key=lambda i: (ratios[i] is None, ratios[i] or 0.0, i))
    return order[(len(order) - 1) // 2]


async def run_probe(base_url: str, duration: float = 5.0, load: LoadSpec | None = None,
                    api_key: str | None = None, model: str | None = None,
                    max_tokens: int = 64, rounds: int = 1) -> dict:
    """`rounds` x (idle phase, then load phase, `duration` s each) on one steady stream; a
    JSON-able report: the median round's figures, and every round's ratios. The load runs in
    another process, so this one's event loop only reads the stream and times its tokens."""
    if rounds < 1:
        raise ValueError(f"the stall probe needs at least one round, got {rounds}")
    load = load or LoadSpec()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    record = StreamRecord()
    rounds_run: list[Phases] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = await _served_model(session, base_url, headers, model)
        stop_stream = asyncio.Event()
        stream = asyncio.create_task(_stream(session, base_url, headers, model, max_tokens,
                                             record, stop_stream))
        try:
            for _ in range(rounds):
                # Started and ready before the idle phase: its start-up falls in neither.
                load_proc = await _start_load(base_url, headers, model, load, duration)
                try:
                    idle_start = time.monotonic()
                    await asyncio.sleep(duration)
                    idle_end = time.monotonic()
                    loaded = await _run_load(load_proc)
                    rounds_run.append(Phases(idle_start, idle_end, time.monotonic(), loaded))
                finally:
                    if load_proc.returncode is None:
                        with contextlib.suppress(ProcessLookupError):
                            load_proc.kill()
                        await load_proc.wait()
                if stream.done():
                    break  # it failed: awaited below, which raises its error
        finally:
            stop_stream.set()
            await stream
    reports = [round_report(record, phases) for phases in rounds_run]
    chosen = median_round([r["max_gap_ratio"] for r in reports])
    return {**reports[chosen], "median_round": chosen,
            "rounds": [{"max_gap_ratio": r["max_gap_ratio"],
                        "idle_max_gap_ms": r["idle"]["max_gap_ms"],
                        "loaded_max_gap_ms": r["loaded"]["max_gap_ms"],
                        "teardown_max_gap_ratio": r["teardown"]["max_gap_ratio"]}
                       for r in reports],
            "load": dataclasses.asdict(load), "duration_s": duration}
