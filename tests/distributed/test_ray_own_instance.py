"""An engine on --distributed-executor-backend ray with no Ray to join starts a local one, and
stops it at shutdown: its core process leaves by os._exit (no atexit handler, so no
ray.shutdown), and Ray's dashboard and runtime-env agents outlived it by a minute or more."""
import os
import sys
import time

from kiln.executor.rank_errors import process_state

from checkpoints import hf_greedy
from parallel_helpers import MAX_TOKENS, PROMPTS, generate_ids, make_llm


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _running(pids: list[int]) -> list[int]:
    return [p for p in pids if process_state(p) not in ("", "Z", "X")]


def test_the_ray_an_engine_core_started_stops_with_it(tiny_llama_dir, monkeypatch, bounded):
    monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "1")  # the core in its own process
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized()  # the core has no Ray to join
    llm = make_llm(tiny_llama_dir, tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        ray_processes = _descendants(llm.llm_engine.engine_core.pid)
        assert generate_ids(llm) == hf_greedy(tiny_llama_dir, PROMPTS, MAX_TOKENS)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert len(ray_processes) > 2  # Ray's own processes and the two rank actors
    deadline = time.monotonic() + 20
    while _running(ray_processes) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _running(ray_processes)
    assert left == [], [open(f"/proc/{p}/cmdline").read()[:80] for p in left]
