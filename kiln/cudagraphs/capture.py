"""The model runner's CUDA graph steps: resolve and build the dispatcher, record every graph.

`setup_cudagraphs` runs before the model is compiled; `capture_model` at the end of warm-up.
"""
import numpy as np
import torch

from kiln.cudagraphs.dispatcher import CudagraphDispatcher
from kiln.cudagraphs.mode import BatchDescriptor, CUDAGraphMode
from kiln.cudagraphs.wrapper import capture_phase
from kiln.errors import ConfigError
from kiln.forward_context import set_forward_context


def setup_cudagraphs(kiln_config, platform=None) -> CudagraphDispatcher:
    """The dispatcher of the resolved cudagraph mode and capture sizes (the model runner hands
    its mode to the piecewise backend through its CompileState)."""
    return CudagraphDispatcher.from_config(kiln_config, platform)


def dummy_query_lens(desc: BatchDescriptor, max_num_reqs: int, max_model_len: int) -> np.ndarray:
    """Query length per request of the dummy batch a FULL graph is recorded with.

    All-decode keys: desc.num_reqs requests of one token. Token-count keys: the tokens spread
    over min(num_tokens, max_num_reqs) requests (the remainder on the last); at serving such a
    graph sees the real request count, so a FULL-capable backend must not bake it in.
    """
    n = desc.num_tokens
    if desc.uniform_decode:
        return np.ones(desc.num_reqs, dtype=np.int64)
    busy = min(n, max_num_reqs)
    lens = np.full(busy, n // busy, dtype=np.int64)
    lens[-1] += n % busy
    if lens.max() > max_model_len:
        raise ConfigError(f"a FULL graph of {n} tokens needs requests longer than max_model_len "
                          f"({max_model_len}); lower compilation_config.max_cudagraph_capture_size")
    return lens


def fill_dummy_step(runner, desc: BatchDescriptor, with_metadata: bool):
    """Write a dummy step for `desc` into the runner's persistent buffers.

    Returns (input_ids, positions, attn_metadata); metadata (FULL graphs only: attention is
    inside them) describes requests starting at position 0 whose tokens write no cache slot.
    """
    n, buf = desc.num_tokens, runner.buffers
    if not with_metadata:
        return (*buf.dummy_tokens(n, np.arange(n) % runner.max_model_len), None)
    lens = dummy_query_lens(desc, runner.max_num_reqs, runner.max_model_len)
    r = len(lens)
    qsl = np.zeros(r + 1, dtype=np.int32)
    np.cumsum(lens, out=qsl[1:])
    buf.group_slot_mapping_np[:, :n] = -1
    buf.query_start_loc_np[:r + 1] = qsl
    buf.seq_lens_np[:r] = lens
    buf.group_block_table_np[:, :r] = 0
    md = buf.attention_metadata(n, r, int(lens.max()), int(lens.max()), n, desc.uniform_decode)
    return (*buf.dummy_tokens(n, np.arange(n) - np.repeat(qsl[:-1], lens)), md)


@torch.inference_mode()
def capture_model(runner, dispatcher: CudagraphDispatcher, platform=None) -> int:
    """Record every key of the dispatcher's plan (PIECEWISE before FULL, largest first), each
    after one eager run of the same batch so lazy initialisation happens outside capture.
    Returns the number of keys recorded."""
    if platform is None:
        platform = runner.kiln_config.platform
    plan = dispatcher.capture_plan()
    if not plan:
        return 0
    with capture_phase(mem_get_info=platform.mem_get_info):
        for mode, desc in plan:
            ids, pos, md = fill_dummy_step(runner, desc, with_metadata=mode is CUDAGraphMode.FULL)
            for step_mode in (CUDAGraphMode.NONE, mode):
                with set_forward_context(md, runner.kiln_config, layers=runner.attention_layers,
                                         batch_descriptor=desc,
                                         cudagraph_runtime_mode=step_mode):
                    runner.model(ids, pos)
    platform.synchronize()
    return len(plan)
