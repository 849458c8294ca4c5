"""The periodic stats log line on a scripted clock: right throughput while busy, a final line
when the engine drains, silence while idle, and no idle gap (or zero time) in the numbers."""
import contextlib
import time

from kiln.engine.request_stats import IterationStats, LoggingStatLogger


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def busy(running=2, waiting=1, **kw):
    return dict(num_running=running, num_waiting=waiting, kv_cache_usage=0.25, **kw)


IDLE = dict(num_running=0, num_waiting=0, kv_cache_usage=0.0)


def make():
    clock, lines = Clock(), []
    return LoggingStatLogger(interval=5.0, clock=clock, emit=lines.append), clock, lines


def test_lines_every_interval_with_the_right_throughput():
    log, clock, lines = make()
    log.record(IterationStats(num_prompt_tokens=50, time_to_first_tokens=[0.0]), busy())
    for _ in range(100):  # 10 s of steps, 20 tokens each, one per 0.1 s
        clock.t += 0.1
        log.record(IterationStats(num_generation_tokens=20), busy())
    assert len(lines) == 2
    assert "Avg prompt throughput: 10.0 tokens/s" in lines[0]
    assert "Avg generation throughput: 200.0 tokens/s" in lines[0]
    assert "Avg generation throughput: 200.0 tokens/s" in lines[1]
    assert "Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%" in lines[1]


def test_drain_logs_once_then_silence_and_an_idle_gap_does_not_dilute():
    log, clock, lines = make()
    log.record(IterationStats(), busy())
    clock.t += 1.0
    log.record(IterationStats(num_generation_tokens=10), IDLE)
    assert len(lines) == 1 and "Avg generation throughput: 10.0 tokens/s" in lines[0]
    assert "Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%" in lines[0]
    clock.t += 3600  # an hour idle: records of nothing log nothing
    log.record(IterationStats(), IDLE)
    assert len(lines) == 1
    # A request that arrived 0.5 s ago gets its first token now, and finishes 0.5 s later.
    log.record(IterationStats(num_prompt_tokens=8, num_generation_tokens=1,
                              time_to_first_tokens=[0.5]), busy(running=1, waiting=0))
    clock.t += 0.5
    log.record(IterationStats(num_generation_tokens=1), IDLE)
    assert len(lines) == 2
    assert "Avg prompt throughput: 8.0 tokens/s, Avg generation throughput: 2.0" in lines[1]


def test_no_time_passed_is_no_division_by_zero():
    log, clock, lines = make()
    log.record(IterationStats(num_generation_tokens=3), IDLE)
    assert lines == ["Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 "
                     "tokens/s, Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%, "
                     "Prefix cache hit rate: 0.0%"]


def test_prefix_cache_hit_rate_is_over_the_window():
    log, clock, lines = make()
    log.record(IterationStats(), busy(prefix_cache_queries=100, prefix_cache_hits=100))
    clock.t += 5
    log.record(IterationStats(), busy(prefix_cache_queries=100, prefix_cache_hits=100))
    clock.t += 5
    log.record(IterationStats(), busy(prefix_cache_queries=200, prefix_cache_hits=125))
    assert "Prefix cache hit rate: 100.0%" in lines[0]
    assert "Prefix cache hit rate: 25.0%" in lines[1]


def test_the_server_logs_a_line_when_it_drains():
    from fastapi.testclient import TestClient

    from kiln.engine.async_llm import AsyncLLM
    from kiln.entrypoints.openai.api_server import ServerSettings, build_app

    from .fake_engine import FakeEngine

    app = build_app(AsyncLLM(FakeEngine()), ServerSettings())
    lines = []
    app.state.metrics.stats_log._emit = lines.append
    with TestClient(app) as c:
        assert c.post("/v1/completions", json=dict(prompt="abc", max_tokens=3)).status_code == 200
    assert len(lines) == 1 and "Running: 0 reqs, Waiting: 0 reqs" in lines[0], lines


def test_back_to_back_requests_log_one_line_per_interval_not_one_each():
    """Each of a sequential client's requests drains the engine: a line per request flooded the
    log (vLLM logs once per interval). A drain too soon after the last line waits for its time
    and then says it is idle, with the throughput of all the requests it covers."""
    clock, lines, timers = Clock(), [], []

    def schedule(delay, fn):
        timers.append((clock.t + delay, fn))
        return True

    log = LoggingStatLogger(interval=5.0, clock=clock, emit=lines.append, schedule=schedule)
    for _ in range(10):  # ten 0.4 s requests, 0.1 s apart: 10 generated tokens each
        log.record(IterationStats(num_prompt_tokens=4), busy(running=1, waiting=0))
        clock.t += 0.4
        log.record(IterationStats(num_generation_tokens=10), IDLE)
        clock.t += 0.1
    assert len(lines) == 1 and len(timers) == 1  # the first drain; one more pending
    due, fn = timers.pop()
    assert due == 1000.0 + 0.4 + 5.0
    clock.t = due
    fn()
    assert len(lines) == 2
    # Requests 2-10 (90 tokens) from the second's arrival (1000.5) to the last drain (1004.9).
    assert "Avg generation throughput: 20.5 tokens/s" in lines[1]
    assert "Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%" in lines[1]
    clock.t += 3600  # idle: nothing more; a later drain logs at once (the last line is old)
    log.record(IterationStats(num_prompt_tokens=4), busy(running=1, waiting=0))
    clock.t += 1.0
    log.record(IterationStats(num_generation_tokens=10), IDLE)
    assert len(lines) == 3 and not timers


def test_a_request_before_the_deferred_line_keeps_the_window_open():
    clock, lines, timers = Clock(), [], []
    log = LoggingStatLogger(interval=5.0, clock=clock, emit=lines.append,
                            schedule=lambda delay, fn: timers.append(fn) or True)
    log.record(IterationStats(num_generation_tokens=5), IDLE)  # first drain: logged
    log.record(IterationStats(num_generation_tokens=5), busy())
    clock.t += 1
    log.record(IterationStats(num_generation_tokens=5), IDLE)  # deferred
    log.record(IterationStats(num_generation_tokens=5), busy())  # busy again before it
    clock.t += 4
    log.record(IterationStats(num_generation_tokens=5), busy())  # the interval's own line
    assert len(lines) == 2 and "Running: 2 reqs" in lines[1]
    timers.pop()()  # its drain line was overtaken: nothing more
    assert len(lines) == 2


def test_the_server_logs_sequential_requests_once_per_interval():
    import time

    from fastapi.testclient import TestClient

    from kiln.engine.async_llm import AsyncLLM
    from kiln.entrypoints.openai.api_server import ServerSettings, build_app

    from .fake_engine import FakeEngine

    app = build_app(AsyncLLM(FakeEngine()), ServerSettings(stats_log_interval=2.0))
    lines = []
    app.state.metrics.stats_log._emit = lines.append
    with TestClient(app) as c:
        start = time.monotonic()
        for _ in range(4):
            assert c.post("/v1/completions",
                          json=dict(prompt="abc", max_tokens=3)).status_code == 200
        # A line per request was 4; one per 2 s is 1 (2 on a machine slow enough to take 2 s).
        assert len(lines) <= 1 + (time.monotonic() - start) // 2.0 < 4, lines
        logged = len(lines)
        time.sleep(2.5)  # the deferred line, on the server's event loop
        assert len(lines) == logged + 1, lines
        assert "Running: 0 reqs, Waiting: 0 reqs" in lines[-1]


def test_a_drain_logged_at_its_time_leaves_nothing_for_a_late_flush():
    """The event loop ran the flush late: a drain that came after its time logged at once, and
    the flush must not log that window a second time."""
    clock, lines, timers = Clock(), [], []
    log = LoggingStatLogger(interval=5.0, clock=clock, emit=lines.append,
                            schedule=lambda delay, fn: timers.append(fn) or True)
    log.record(IterationStats(num_generation_tokens=5), IDLE)  # logged
    log.record(IterationStats(num_generation_tokens=5), busy())
    clock.t += 1
    log.record(IterationStats(num_generation_tokens=5), IDLE)  # deferred
    clock.t += 5
    log.record(IterationStats(num_generation_tokens=5), IDLE)  # past its time: logged now
    assert len(lines) == 2
    timers.pop()()
    assert len(lines) == 2


def test_a_drain_line_still_due_is_logged_when_the_server_stops():
    """Otherwise the log's last line could say requests were running (a busy window's line)."""
    from fastapi.testclient import TestClient

    from kiln.engine.async_llm import AsyncLLM
    from kiln.entrypoints.openai.api_server import ServerSettings, build_app

    from .fake_engine import FakeEngine

    app = build_app(AsyncLLM(FakeEngine()), ServerSettings(stats_log_interval=600.0))
    lines = []
    app.state.metrics.stats_log._emit = lines.append
    with TestClient(app) as c:
        for _ in range(2):
            assert c.post("/v1/completions",
                          json=dict(prompt="abc", max_tokens=3)).status_code == 200
        assert len(lines) == 1
    assert len(lines) == 2 and "Running: 0 reqs, Waiting: 0 reqs" in lines[1], lines


def test_a_window_still_open_when_the_engine_stops_is_logged_as_drained():
    """Aborts are recorded with the engine's stats of the step before them, and no step
    follows a shutdown: the server's stop logs the open window as drained (nothing runs once
    its requests are aborted), once."""
    log, clock, lines = make()
    log.record(IterationStats(num_generation_tokens=5), busy())
    clock.t += 1
    log.record(IterationStats(num_generation_tokens=5), busy())  # the aborts, stale stats
    log.flush()  # not stopped: a busy window stays open
    assert lines == []
    log.flush(stopped=True)
    assert len(lines) == 1 and "Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%" in \
        lines[0], lines
    assert "generation throughput: 10.0 tokens/s" in lines[0]
    log.flush(stopped=True)
    assert len(lines) == 1


def test_the_server_stopping_with_requests_in_flight_logs_that_it_drained():
    import threading

    import httpx

    from kiln.engine.async_llm import AsyncLLM
    from kiln.entrypoints.openai.api_server import ServerSettings, build_app

    from .fake_engine import FakeEngine
    from .uvicorn_thread import uvicorn_in_thread

    app = build_app(AsyncLLM(FakeEngine(max_model_len=4096, step_delay=0.05)),
                    ServerSettings(stats_log_interval=600.0))
    lines = []
    app.state.metrics.stats_log._emit = lines.append
    with uvicorn_in_thread(app, timeout_graceful_shutdown=1) as port:
        def generate():
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                           json=dict(prompt="abc", max_tokens=2000), timeout=60)
        threading.Thread(target=generate, daemon=True).start()
        while app.state.llm.num_in_flight == 0:
            time.sleep(0.05)
        time.sleep(0.3)
    assert len(lines) == 1 and "Running: 0 reqs, Waiting: 0 reqs" in lines[0], lines


def spec(drafts, draft_tokens, accepted, per_pos):
    return dict(spec_decode_num_drafts=drafts, spec_decode_num_draft_tokens=draft_tokens,
                spec_decode_num_accepted_tokens=accepted,
                spec_decode_num_accepted_tokens_per_pos=per_pos)


def test_speculation_adds_vllms_spec_decoding_line_over_the_window():
    """vLLM's "SpecDecoding metrics:" line follows the stats line, over the same window; none
    without speculation (no positions) or in a window that ran no drafts."""
    log, clock, lines = make()
    log.record(IterationStats(num_generation_tokens=1), busy(**spec(0, 0, 0, [0, 0, 0])))
    clock.t += 2.0
    log.record(IterationStats(num_generation_tokens=30), IDLE | spec(10, 30, 15, [8, 5, 2]))
    assert len(lines) == 2 and lines[0].startswith("Avg prompt throughput")
    assert lines[1] == ("SpecDecoding metrics: Mean acceptance length: 2.50, Accepted "
                        "throughput: 7.50 tokens/s, Drafted throughput: 15.00 tokens/s, "
                        "Accepted: 15 tokens, Drafted: 30 tokens, Per-position acceptance "
                        "rate: 0.800, 0.500, 0.200, Avg Draft acceptance rate: 50.0%")
    clock.t += 10.0  # the next window: its own drafts only
    log.record(IterationStats(num_generation_tokens=1), busy(**spec(10, 30, 15, [8, 5, 2])))
    clock.t += 4.0
    log.record(IterationStats(num_generation_tokens=9), IDLE | spec(14, 42, 18, [4 + 8, 5, 2 + 1]))
    assert lines[-1].startswith("SpecDecoding metrics: Mean acceptance length: 1.75, Accepted "
                                "throughput: 0.75 tokens/s, Drafted throughput: 3.00 tokens/s")
    assert lines[-1].endswith("rate: 1.000, 0.000, 0.250, Avg Draft acceptance rate: 25.0%")
    n = len(lines)
    clock.t += 10.0  # no drafts this window (a grammar, a prompt with no n-gram match)
    log.record(IterationStats(num_generation_tokens=1), busy(**spec(14, 42, 18, [12, 5, 3])))
    clock.t += 4.0
    log.record(IterationStats(num_generation_tokens=9), IDLE | spec(14, 42, 18, [12, 5, 3]))
    assert len(lines) == n + 1 and lines[-1].startswith("Avg prompt throughput")
    clock.t += 10.0  # without speculation: no line
    log.record(IterationStats(num_generation_tokens=1), busy())
    clock.t += 4.0
    log.record(IterationStats(num_generation_tokens=9), IDLE)
    assert len(lines) == n + 2 and lines[-1].startswith("Avg prompt throughput")
