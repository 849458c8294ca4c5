"""Front-end lanes: a huge input goes to its own (lower-priority) thread, so a short prompt
never queues behind it."""
import os
import threading

from kiln.engine.frontend_lanes import (
    BULK_CHARS,
    BULK_NICENESS,
    ITEM_CHARS,
    FrontendLanes,
    input_size,
    is_bulk,
)


def test_input_size_counts_text_and_ids_in_prompts_and_messages():
    assert input_size("abc") == 3
    assert input_size({"prompt": "ab", "cache_salt": "x"}) == 3
    assert input_size({"prompt_token_ids": [1, 2, 3, 4]}) == 4
    assert input_size([{"role": "user", "content": [{"type": "text", "text": "hey"}]}]) == 11  # values
    assert input_size(object()) == 0
    assert not is_bulk(("x" * BULK_CHARS,), {})
    assert is_bulk(("x" * BULK_CHARS, "y"), {}) and is_bulk((), {"text": "x" * (BULK_CHARS + 1)})


def test_request_models_count_their_fields_and_long_lists_are_bulk_unwalked():
    from kiln.entrypoints.openai.protocol import ChatMessage

    parts = ChatMessage.model_validate({"role": "user", "content": [{"type": "text",
                                                                     "text": "hey"}]})
    assert input_size([ChatMessage(role="user", content="hello")]) == 9  # role + content
    assert input_size([parts]) == input_size([parts.model_dump()]) == 11
    assert is_bulk(([ChatMessage(role="user", content="x" * BULK_CHARS)],), {})

    class Unwalkable(dict):
        def values(self):
            raise AssertionError("a long list's items are not walked")

    many = [Unwalkable()] * (BULK_CHARS // ITEM_CHARS + 1)
    assert is_bulk((many,), {})
    assert not is_bulk(([{"role": "user", "content": "hi"}] * 100,), {})


def test_a_short_call_runs_while_a_huge_one_is_still_going():
    lanes = FrontendLanes()
    release = threading.Event()
    try:
        huge = lanes.submit(lambda text: release.wait(30), "x" * (BULK_CHARS + 1))
        assert lanes.submit(len, "short").result(timeout=10) == 5  # not behind the huge one
        assert not huge.done()
        release.set()
        assert huge.result(timeout=10)
    finally:
        release.set()
        lanes.shutdown()


def test_the_bulk_thread_yields_the_cpu():
    """Linux's nice is per thread (Kiln's core client is Linux-only too: pidfd)."""
    lanes = FrontendLanes()
    try:
        base = os.getpriority(os.PRIO_PROCESS, 0)
        tid = lanes.submit(lambda text: threading.get_native_id(), "x" * (BULK_CHARS + 1))
        tid = tid.result(timeout=10)
        assert os.getpriority(os.PRIO_PROCESS, tid) == min(19, base + BULK_NICENESS)
        ordinary = lanes.submit(threading.get_native_id).result(timeout=10)
        assert os.getpriority(os.PRIO_PROCESS, ordinary) == base
    finally:
        lanes.shutdown()


def test_lowering_the_front_end_lowers_every_thread_of_this_process_only():
    """In a child process (never renice the test runner): its threads all yield, a process it
    started before keeps its priority, a thread started after inherits the lower one."""
    import subprocess
    import sys

    code = """
import os, subprocess, sys, threading, time
from kiln.engine.frontend_lanes import lower_front_end
core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
ready = threading.Event()
threading.Thread(target=lambda: (ready.set(), time.sleep(30)), daemon=True).start()
ready.wait()
base = os.getpriority(os.PRIO_PROCESS, 0)
n = lower_front_end(3)
later = []
t = threading.Thread(target=lambda: later.append(os.getpriority(os.PRIO_PROCESS, 0)))
t.start(); t.join()
def priority(tid):  # None: a thread that exited after listdir (t, just joined, may linger)
    try:
        return os.getpriority(os.PRIO_PROCESS, tid)
    except ProcessLookupError:
        return None
live = [p for p in map(priority, map(int, os.listdir("/proc/self/task"))) if p is not None]
print(n >= 2, bool(live) and all(p == min(19, base + 3) for p in live),
      os.getpriority(os.PRIO_PROCESS, core.pid) == base, later == [min(19, base + 3)])
core.kill()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.split() == ["True"] * 4, out.stderr


def test_the_front_end_yields_by_default_only_where_it_shares_every_core():
    from kiln.engine.frontend_lanes import SHARED_CORES_NICENESS, frontend_niceness

    assert frontend_niceness(None, core_threads=1, cores=2) == 0  # the core left it one
    assert frontend_niceness(None, core_threads=2, cores=2) == SHARED_CORES_NICENESS
    assert frontend_niceness(None, core_threads=None, cores=2) == SHARED_CORES_NICENESS
    assert frontend_niceness(7, core_threads=1, cores=2) == 7  # the user's choice
    assert frontend_niceness(0, core_threads=2, cores=2) == 0


def test_sampling_params_count_their_bad_words_and_long_dicts_are_bulk_unwalked():
    """bad_words are tokenized word by word in the call that reads a prompt: a short prompt
    with 100,000 of them went to the ordinary lane and every short prompt waited behind it."""
    from kiln.sampling_params import SamplingParams

    words = ["w"] * (BULK_CHARS // ITEM_CHARS + 1)
    assert is_bulk(("x", SamplingParams(bad_words=words)), {"max_tokens_must_fit": True})
    assert is_bulk(("x", SamplingParams(bad_words=["a" * 100] * 700)), {})
    assert not is_bulk(("x", SamplingParams(bad_words=["word"] * 100, stop=["s"])), {})

    class Unwalkable(dict):
        def values(self):
            raise AssertionError("a long dict's values are not walked")

    assert is_bulk((Unwalkable({i: 1.0 for i in range(BULK_CHARS // ITEM_CHARS + 1)}),), {})
