"""Mode resolution (CPU, eager, downgrades) and the dispatcher's per-batch decisions."""
import logging
from types import SimpleNamespace

import pytest

from kiln.config.compilation_config import CompilationConfig
from kiln.config.scheduler_config import SchedulerConfig
from kiln.cudagraphs.dispatcher import CudagraphDispatcher, resolve_cudagraph_config, resolve_cudagraph_mode
from kiln.cudagraphs.mode import BatchDescriptor, CUDAGraphMode
from kiln.platforms import CpuPlatform, CudaPlatform

M = CUDAGraphMode
B = BatchDescriptor


def resolve(requested, *, gpu=True, eager=False, mode=3, split=True, full=True):
    return resolve_cudagraph_mode(requested, platform_supports_cudagraph=gpu,
                                  enforce_eager=eager, compilation_mode=mode,
                                  has_splitting_ops=split, attn_supports_full=full)


@pytest.mark.parametrize("requested", [None] + list(M))
def test_cpu_resolves_everything_to_none(requested):
    mode, reasons = resolve(requested, gpu=False)
    assert mode is M.NONE
    assert reasons == ([] if requested is M.NONE else ["this platform has no CUDA graphs"])


@pytest.mark.parametrize("requested", [None] + list(M))
def test_enforce_eager_turns_graphs_off(requested):
    assert resolve(requested, eager=True, mode=0)[0] is M.NONE


def test_defaults():
    assert resolve(None) == (M.FULL_AND_PIECEWISE, [])
    assert resolve(None, mode=0) == (M.NONE, [])  # no compile: no graphs unless asked for
    assert resolve(None, mode=2) == (M.NONE, [])
    assert resolve(None, full=False)[0] is M.PIECEWISE


def test_everything_supported_keeps_the_request():
    for m in M:
        assert resolve(m) == (m, [])


@pytest.mark.parametrize("requested, expected", [
    (M.PIECEWISE, M.NONE),
    (M.FULL_AND_PIECEWISE, M.FULL_DECODE_ONLY),
    (M.FULL, M.FULL),  # a FULL graph over the uncompiled (or stock-compiled) model is fine
    (M.FULL_DECODE_ONLY, M.FULL_DECODE_ONLY),
])
@pytest.mark.parametrize("comp_mode, split", [(0, True), (1, True), (2, True), (3, False)])
def test_piecewise_needs_the_piecewise_stack(requested, expected, comp_mode, split):
    mode, reasons = resolve(requested, mode=comp_mode, split=split)
    assert mode is expected
    assert bool(reasons) == (expected is not requested)


@pytest.mark.parametrize("requested, comp_mode, expected", [
    (M.FULL, 3, M.PIECEWISE),
    (M.FULL, 0, M.NONE),
    (M.FULL_DECODE_ONLY, 3, M.NONE),
    (M.FULL_AND_PIECEWISE, 3, M.PIECEWISE),
    (M.FULL_AND_PIECEWISE, 1, M.NONE),  # loses the piecewise half, then the full half
    (M.PIECEWISE, 3, M.PIECEWISE),
])
def test_full_needs_attention_support(requested, comp_mode, expected):
    mode, reasons = resolve(requested, mode=comp_mode, full=False)
    assert mode is expected
    assert any("attention backend" in r for r in reasons) == requested.has_full_cudagraphs()


def _config(cudagraph_mode=None, sizes=None, max_size=None, max_num_seqs=4, budget=64,
            enforce_eager=False, mode=3):
    cc = CompilationConfig(mode=mode, cudagraph_mode=cudagraph_mode,
                           cudagraph_capture_sizes=sizes, max_cudagraph_capture_size=max_size)
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    return SimpleNamespace(compilation_config=cc, scheduler_config=sched,
                           enforce_eager=enforce_eager)


def test_resolve_config_on_cpu_logs_and_leaves_the_config_alone(caplog):
    cfg = _config("FULL_AND_PIECEWISE")
    logger = logging.getLogger("kiln")
    logger.addHandler(caplog.handler)  # kiln's logger does not propagate to the root
    try:
        with caplog.at_level(logging.INFO, logger="kiln"):
            mode, sizes = resolve_cudagraph_config(cfg, platform=CpuPlatform())
    finally:
        logger.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if "cudagraph_mode" in r.getMessage()]
    assert lines == ["cudagraph_mode FULL_AND_PIECEWISE resolves to NONE on cpu: this platform "
                     "has no CUDA graphs"]
    assert mode is M.NONE
    assert sizes == [1, 2, 4, 8] and sizes[-1] == 8
    cc = cfg.compilation_config  # the request stays as it was: the result is runtime state
    assert cc.cudagraph_mode == "FULL_AND_PIECEWISE" and cc.cudagraph_capture_sizes is None
    assert resolve_cudagraph_config(cfg, platform=CpuPlatform()) == (mode, sizes)


def test_resolve_config_on_cuda_uses_the_attention_flag():
    cfg = _config(None, sizes=[4, 1, 2])
    mode, sizes = resolve_cudagraph_config(cfg, platform=CudaPlatform(), attn_supports_full=False)
    assert mode is M.PIECEWISE
    assert sizes == [1, 2, 4]
    # The real backend's flag is read when none is given.
    from kiln.attention.backend import get_attn_backend
    cfg = _config("FULL")
    expected = M.FULL if get_attn_backend().supports_full_cudagraph else M.PIECEWISE
    assert resolve_cudagraph_config(cfg, platform=CudaPlatform())[0] is expected


def test_dispatcher_from_config_holds_the_resolution():
    cfg = _config("PIECEWISE")
    dispatcher = CudagraphDispatcher.from_config(cfg, platform=CudaPlatform(),
                                                 attn_supports_full=True)
    assert dispatcher.cudagraph_mode is M.PIECEWISE and dispatcher.max_capture_size == 8
    assert CudagraphDispatcher.from_config(cfg, platform=CpuPlatform()).cudagraph_mode is M.NONE


SIZES = [1, 2, 4, 8, 16]


def _dispatcher(mode, max_num_seqs=8):
    return CudagraphDispatcher(mode, SIZES, max_num_seqs=max_num_seqs)


def test_keys_per_mode():
    tokens_only = {B(s) for s in SIZES}
    decode = {B(s, s, True) for s in SIZES if s <= 8}
    cases = {
        M.NONE: (set(), set()),
        M.PIECEWISE: (tokens_only, set()),
        M.FULL: (set(), tokens_only),
        M.FULL_DECODE_ONLY: (set(), decode),
        M.FULL_AND_PIECEWISE: (tokens_only, decode),
    }
    for mode, (piecewise, full) in cases.items():
        d = _dispatcher(mode)
        assert d.keys[M.PIECEWISE] == piecewise and d.keys[M.FULL] == full, mode


# (num_tokens, num_reqs, uniform_decode) -> expected (mode, descriptor) for each cudagraph mode.
DECODE_3 = (3, 3, True)  # all-decode, pads to 4
MIXED_5 = (5, 2, False)  # prefill + decode, pads to 8
DECODE_16 = (16, 16, True)  # all-decode past max_num_seqs=8: only a token-count key fits
ABOVE = (17, 3, False)  # above the largest capture size: eager, unpadded
ABOVE_DECODE = (20, 20, True)


@pytest.mark.parametrize("mode, batch, expected", [
    (M.NONE, DECODE_3, (M.NONE, B(3, 3, True))),
    (M.NONE, MIXED_5, (M.NONE, B(5, 2, False))),
    (M.PIECEWISE, DECODE_3, (M.PIECEWISE, B(4))),
    (M.PIECEWISE, MIXED_5, (M.PIECEWISE, B(8))),
    (M.PIECEWISE, ABOVE, (M.NONE, B(17, 3, False))),
    (M.FULL, DECODE_3, (M.FULL, B(4))),  # decode reuses the mixed FULL graph
    (M.FULL, MIXED_5, (M.FULL, B(8))),
    (M.FULL, ABOVE_DECODE, (M.NONE, B(20, 20, True))),
    (M.FULL_DECODE_ONLY, DECODE_3, (M.FULL, B(4, 4, True))),
    (M.FULL_DECODE_ONLY, MIXED_5, (M.NONE, B(5, 2, False))),
    (M.FULL_DECODE_ONLY, DECODE_16, (M.NONE, B(16, 16, True))),
    (M.FULL_AND_PIECEWISE, DECODE_3, (M.FULL, B(4, 4, True))),
    (M.FULL_AND_PIECEWISE, (8, 8, True), (M.FULL, B(8, 8, True))),
    (M.FULL_AND_PIECEWISE, MIXED_5, (M.PIECEWISE, B(8))),
    (M.FULL_AND_PIECEWISE, DECODE_16, (M.PIECEWISE, B(16))),
    (M.FULL_AND_PIECEWISE, ABOVE, (M.NONE, B(17, 3, False))),
    (M.FULL_AND_PIECEWISE, ABOVE_DECODE, (M.NONE, B(20, 20, True))),
])
def test_dispatch(mode, batch, expected):
    assert _dispatcher(mode).dispatch(*batch) == expected


def test_dispatch_exact_sizes_are_not_padded():
    d = _dispatcher(M.FULL_AND_PIECEWISE)
    for s in SIZES:
        assert d.dispatch(s, 1, False) == (M.PIECEWISE, B(s))


def test_dispatch_rejects_bad_batches():
    d = _dispatcher(M.PIECEWISE)
    with pytest.raises(ValueError, match="num_tokens >= 1"):
        d.dispatch(0, 0, False)
    with pytest.raises(ValueError, match="one token per request"):
        d.dispatch(4, 2, True)


def test_capture_plan_piecewise_first_largest_first():
    plan = _dispatcher(M.FULL_AND_PIECEWISE).capture_plan()
    assert plan == [(M.PIECEWISE, B(s)) for s in (16, 8, 4, 2, 1)] + \
        [(M.FULL, B(s, s, True)) for s in (8, 4, 2, 1)]
    assert _dispatcher(M.NONE).capture_plan() == []
    assert _dispatcher(M.NONE).max_capture_size == 0
    assert [d.num_tokens for _, d in _dispatcher(M.FULL).capture_plan()] == [16, 8, 4, 2, 1]


def test_cpu_engine_on_a_gpu_host_takes_the_cpu_platform(monkeypatch):
    """The machine's platform is CUDA wherever a GPU is; an engine configured for the CPU must
    still get the CPU's dtype, attention backend and no CUDA graphs."""
    import torch
    from transformers import LlamaConfig

    import kiln.platforms
    from kiln.attention.backend import get_attn_backend
    from kiln.config import DeviceConfig, KilnConfig, ModelConfig

    monkeypatch.setattr(kiln.platforms, "current_platform", CudaPlatform())
    hf = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                     max_position_embeddings=512, dtype="bfloat16")
    model_config = ModelConfig(model="unused", hf_config=hf, load_format="dummy")
    assert model_config.torch_dtype == torch.bfloat16  # what the machine's platform gives
    cfg = KilnConfig(model_config=model_config, device_config=DeviceConfig("cpu"),
                     compilation_config=CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE"))
    assert isinstance(cfg.platform, CpuPlatform)
    assert cfg.model_config.torch_dtype == torch.float32
    assert resolve_cudagraph_config(cfg)[0] is M.NONE
    assert get_attn_backend(cfg.platform) is get_attn_backend(CpuPlatform())
    from kiln.native import paged_attention

    if paged_attention.available():  # the layer takes the device's backend, not the machine's
        from kiln.attention.cpu_backend import CpuAttentionBackend
        from kiln.config import set_current_kiln_config
        from kiln.model.layers.attention import Attention

        assert get_attn_backend() is not CpuAttentionBackend
        with set_current_kiln_config(cfg):
            layer = Attention(4, 16, 0.25, 2, prefix="layers.0.attn")
        assert layer.backend is CpuAttentionBackend
