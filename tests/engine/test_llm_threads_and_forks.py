"""LLM calls besides generate from another thread or a forked child: each waits for the running
batch, or is refused (or does nothing) in a child, instead of hanging on the core's sockets."""
import os
import subprocess
import sys
import threading

from kiln.entrypoints.llm import LLM
from kiln.sampling_params import SamplingParams

ENGINE = dict(enforce_eager=True, max_model_len=64, kv_cache_memory=0.01)


def test_reset_prefix_cache_while_another_thread_generates(tiny_llama_dir):
    """The batch's step loop read the reset's answer from the core and dropped it: the reset
    then waited for good."""
    llm = LLM(model=str(tiny_llama_dir), **ENGINE)
    try:
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        started = threading.Event()
        results = []

        def generate():
            started.set()
            results.append(llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 4, params,
                                        use_tqdm=False))
        batch = threading.Thread(target=generate, daemon=True)
        batch.start()
        started.wait()
        resets = threading.Thread(target=lambda: [llm.reset_prefix_cache() for _ in range(10)],
                                  daemon=True)
        resets.start()
        resets.join(60)
        batch.join(60)
        assert not resets.is_alive(), "reset_prefix_cache hangs beside a running batch"
        assert len(results) == 1 and all(len(o.outputs[0].token_ids) == 40 for o in results[0])
    finally:
        llm.shutdown()


def test_a_forked_child_neither_hangs_in_nor_waits_on_its_parents_engine(tiny_llama_dir):
    """reset_prefix_cache in a forked child waited for good for the parent's core; shutdown
    there waited 10 s for a goodbye to a message that never left."""
    code = f"""
import os, sys, time
from kiln.entrypoints.llm import LLM
from kiln.sampling_params import SamplingParams
llm = LLM(model={str(tiny_llama_dir)!r}, **{ENGINE!r})
pid = os.fork()
if pid == 0:
    try:
        llm.reset_prefix_cache()
        os._exit(4)
    except RuntimeError as e:
        if "forked process" not in str(e):
            os._exit(3)
    start = time.monotonic()
    llm.shutdown()
    os._exit(0 if time.monotonic() - start < 2 else 5)
deadline = time.monotonic() + 30
while (status := os.waitpid(pid, os.WNOHANG)) == (0, 0):
    if time.monotonic() > deadline:
        os.kill(pid, 9)
        sys.exit("the forked child hangs")
    time.sleep(0.05)
assert os.waitstatus_to_exitcode(status[1]) == 0, status
out = llm.generate({{"prompt_token_ids": [1, 2, 3]}}, SamplingParams(max_tokens=2))
print("tokens", len(out[0].outputs[0].token_ids), flush=True)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert run.returncode == 0 and "tokens 2" in run.stdout, run.stderr[-2000:]
