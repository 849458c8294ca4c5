"""An existing Ray cluster named by RAY_ADDRESS (`ray start --head`, as docs/parallelism.md's two-machine
run starts one): PP=2 rank actors placed on it give HF's greedy tokens, and leave nothing
behind on the cluster. Slow: starting a Ray head takes tens of seconds on 2 cores."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kiln.executor.free_port import free_port

from checkpoints import hf_greedy
from parallel_helpers import MAX_TOKENS, PROMPTS, generate_ids, make_llm

RAY = str(Path(sys.executable).with_name("ray"))


@pytest.fixture
def ray_head():
    """A Ray head in the foreground (--block), so stopping it stops this cluster only (`ray stop`
    would stop every Ray on the machine); its temp dir short, as Ray's socket paths must be."""
    import ray

    port, temp = free_port(), tempfile.mkdtemp(prefix="kray")
    address = f"127.0.0.1:{port}"
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--port", str(port), "--num-cpus", "2",
         "--node-ip-address", "127.0.0.1",
         "--include-dashboard", "false", "--temp-dir", temp, "--disable-usage-stats"],
        env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _accepts(port):
            assert head.poll() is None and time.monotonic() < deadline, "the Ray head did not start"
            time.sleep(0.5)
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=60)
        shutil.rmtree(temp, ignore_errors=True)


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_pp2_on_an_existing_ray_cluster_matches_hf(ray_head, tiny_llama_dir, monkeypatch):
    import ray

    monkeypatch.setenv("RAY_ADDRESS", ray_head)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the head has no token either
    llm = make_llm(tiny_llama_dir, pipeline_parallel_size=2, distributed_executor_backend="ray")
    try:
        # joined the head (which names itself by the node's IP), not a Ray of its own
        assert ray.get_runtime_context().gcs_address.rsplit(":", 1)[1] == ray_head.rsplit(":")[1]
        assert generate_ids(llm) == hf_greedy(tiny_llama_dir, PROMPTS, MAX_TOKENS)
        executor = llm.llm_engine.engine_core.executor
        assert len(executor.actors) == 2
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert executor.actors == [] and executor.pg is None
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def test_a_ray_address_nobody_answers_is_an_error_naming_it(tiny_llama_dir, monkeypatch,
                                                            bounded):
    # ray.init retries such an address for good (a typo hung `kiln serve` with no end).
    from kiln.executor import ray_placement

    monkeypatch.setattr(ray_placement, "RAY_CONNECT_WAIT_S", 1.0, raising=False)
    address = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("RAY_ADDRESS", address)
    started = time.monotonic()
    with pytest.raises(ValueError, match=rf"RAY_ADDRESS='{address}': no Ray cluster answers "
                                         r"there \(.*\) after 1 s; start one \(ray start"):
        make_llm(tiny_llama_dir, tensor_parallel_size=2, distributed_executor_backend="ray")
    assert time.monotonic() - started < 30
