"""A service manager's stop: SIGTERM to every process of `kiln serve` (systemd's default,
`timeout`, `kill -- -PGID`). The engine core, its ranks and the bulk tokenizer leave it to the
front end, which finishes the streams in flight within its grace period, then stops them; the
core used to exit at once and cut every stream."""
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from .test_core_process_server import children_running
from .test_server_e2e import NAME, STORIES_DIR, running_server

MAX_TOKENS = 400


def _family(pid: int) -> set[int]:
    """pid and all its descendants."""
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        found.add(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo.extend(int(c) for c in (task / "children").read_text().split())
            except OSError:
                pass  # exited meanwhile
    return found


@pytest.mark.parametrize("extra", [[], ["--tensor-parallel-size", "2"]], ids=["core", "tp2"])
def test_group_sigterm_lets_streams_in_flight_finish(tmp_path, extra):
    args = ["--enforce-eager", "--max-model-len", "512", "--kv-cache-memory", "0.05",
            "--disable-access-log", "--graceful-shutdown-timeout", "60", *extra]
    log = tmp_path / "serve.log"
    env = dict(os.environ, KILN_LOGGING_LEVEL="WARNING")
    with running_server(STORIES_DIR, args, log, env, new_session=True) as (url, proc):
        core = children_running(proc.pid, "kiln.core.core_process")
        assert len(core) == 1, core
        family = _family(proc.pid)
        assert len(family) >= (4 if extra else 2), family  # front end, core (ranks, tokenizer)
        lines: list[str] = []
        started = threading.Event()

        def stream():
            body = dict(model=NAME, prompt="x", max_tokens=MAX_TOKENS, ignore_eos=True,
                        stream=True, stream_options={"include_usage": True})
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(60), log.read_text()
        os.killpg(proc.pid, signal.SIGTERM)
        signalled_at = len(lines)
        assert proc.wait(timeout=90) == 0, log.read_text()
        reader.join(30)
        text = log.read_text()
        assert signalled_at < MAX_TOKENS // 2, "the stream ended before the signal: no test"
        assert lines[-1] == "data: [DONE]", lines[-3:]
        usage = json.loads(lines[-2][len("data: "):])["usage"]
        assert usage["completion_tokens"] == MAX_TOKENS, (usage, text)
        assert "Traceback" not in text and "engine core (pid" in text, text
        if extra:
            assert "rank 1 (pid" in text, text
        deadline = time.monotonic() + 30  # nothing of the server outlives it
        while any(Path(f"/proc/{p}").exists() for p in family) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in family if Path(f"/proc/{p}").exists()]
