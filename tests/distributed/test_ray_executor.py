"""TP=2 on the Ray backend: a local Ray started by the test (2 CPUs), rank actors in a
placement group; greedy tokens equal HF's and the actors are gone after shutdown."""
import pytest

from checkpoints import hf_greedy
from parallel_helpers import MAX_TOKENS, PROMPTS, generate_ids, make_llm


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_tp2_on_ray_matches_hf(local_ray, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, tensor_parallel_size=2, distributed_executor_backend="ray")
    assert generate_ids(llm) == hf_greedy(tiny_llama_dir, PROMPTS, MAX_TOKENS)
    executor = llm.llm_engine.engine_core.executor
    assert len(executor.actors) == 2
    llm.llm_engine.engine_core.shutdown()
    assert executor.actors == [] and executor.pg is None
