"""The capture loop on CPU: plan order, eager run before each capture, dummy FULL metadata that
the real attention backend accepts, and no KV cache writes. Graph recording is a test double."""
import numpy as np
import pytest
import torch
from test_cuda_graph_wrapper import fake_cuda  # noqa: F401  (fixture)

from kiln.compilation.counters import compilation_counter
from kiln.config import CacheConfig, KilnConfig, ModelConfig, SchedulerConfig
from kiln.cudagraphs.capture import capture_model, dummy_query_lens, setup_cudagraphs
from kiln.cudagraphs.dispatcher import CudagraphDispatcher
from kiln.cudagraphs.mode import BatchDescriptor, CUDAGraphMode
from kiln.cudagraphs.wrapper import CUDAGraphWrapper
from kiln.executor.uniproc_executor import UniprocExecutor
from kiln.forward_context import get_forward_context
from kiln.platforms import CpuPlatform

M = CUDAGraphMode
B = BatchDescriptor


def test_dummy_query_lens():
    assert dummy_query_lens(B(4, 4, True), 8, 64).tolist() == [1, 1, 1, 1]
    assert dummy_query_lens(B(2), 4, 64).tolist() == [1, 1]
    assert dummy_query_lens(B(11), 4, 64).tolist() == [2, 2, 2, 5]
    assert dummy_query_lens(B(16), 1, 64).tolist() == [16]
    with pytest.raises(ValueError, match="max_cudagraph_capture_size"):
        dummy_query_lens(B(64), 1, 32)


class Spy:
    """Stands between the FULL wrapper and the model; records what each forward saw."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __call__(self, input_ids, positions):
        ctx = get_forward_context()
        md = ctx.attn_metadata
        self.calls.append((ctx.cudagraph_runtime_mode, ctx.batch_descriptor, input_ids.shape[0],
                           None if md is None else md.num_reqs))
        return self.model(input_ids, positions)


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    cfg = KilnConfig(
        model_config=ModelConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=64),
        cache_config=CacheConfig(block_size=4, kv_cache_memory=0.001),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
        enforce_eager=True)
    ex = UniprocExecutor(cfg)
    ex.initialize_cache(ex.determine_num_blocks())
    yield ex.worker.model_runner
    ex.shutdown()


def test_setup_on_cpu_gives_an_empty_plan(runner):
    dispatcher = setup_cudagraphs(runner.kiln_config, platform=CpuPlatform())
    assert dispatcher.cudagraph_mode is M.NONE
    assert runner.compile_state.cudagraph_mode is M.NONE  # what the backend wraps pieces by
    assert dispatcher.capture_plan() == []
    with compilation_counter.expect(num_cudagraph_captured=0):
        assert capture_model(runner, dispatcher, platform=CpuPlatform()) == 0


def test_capture_plan_runs_eager_then_records(runner, fake_cuda):  # noqa: F811
    dispatcher = CudagraphDispatcher(M.FULL_AND_PIECEWISE, [1, 2, 4, 8], max_num_seqs=4)
    model = runner.model
    spy = Spy(model)
    full = CUDAGraphWrapper(spy, M.FULL, weak_ref_output=True, debug=True)
    layers = runner.attention_layers.values()
    caches_before = [layer.kv_cache.clone() for layer in layers]
    runner.model = full
    try:
        with compilation_counter.expect(num_cudagraph_captured=3):  # FULL only: no piece wrappers
            assert capture_model(runner, dispatcher, platform=CpuPlatform()) == 7
    finally:
        runner.model = model
    expected = []
    for mode, desc in dispatcher.capture_plan():
        reqs = desc.num_reqs if mode is M.FULL else None  # FULL graphs carry real metadata
        expected += [(M.NONE, desc, desc.num_tokens, reqs), (mode, desc, desc.num_tokens, reqs)]
    assert spy.calls == expected
    assert [c[1] for c in spy.calls[:2]] == [B(8), B(8)]  # largest PIECEWISE key first
    assert full.captured_descriptors == [B(s, s, True) for s in (4, 2, 1)]
    for layer, before in zip(layers, caches_before):
        assert torch.equal(layer.kv_cache, before)  # dummy tokens wrote no cache slot
    # Inputs were the runner's persistent buffers: the debug address check passes on replay.
    with compilation_counter.expect(num_cudagraph_replays_full=1):
        from kiln.forward_context import set_forward_context
        with set_forward_context(None, runner.kiln_config, layers=runner.attention_layers,
                                 batch_descriptor=B(2, 2, True),
                                 cudagraph_runtime_mode=M.FULL):
            full(runner.buffers.input_ids[:2], runner.buffers.positions[:2])
    assert np.all(runner.buffers.slot_mapping_np[:4] == -1)
