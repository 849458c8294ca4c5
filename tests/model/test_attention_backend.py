"""The attention backends (portable torch; CPU with the C kernel) and the unified_attention op.

Checks paths against a dense reference: per-request, batched decode, padding, no-metadata warm-up.
"""
import weakref

import pytest
import torch
import torch.nn.functional as F

from kiln.attention.backend import get_attn_backend, kv_cache_shape
from kiln.attention.cpu_backend import CpuAttentionBackend, CpuAttentionImpl, split_requests
from kiln.attention.torch_backend import TorchAttentionBackend, TorchAttentionImpl, write_kv_cache
from kiln.config import CompilationConfig, set_current_kiln_config
from kiln.forward_context import set_forward_context
from kiln.native import paged_attention, prefill_attention
from model._attn_helper import BlockPool, PagedRequest, build_step

NH, NKV, HD, BS = 4, 2, 8, 4

needs_kernel = pytest.mark.skipif(not paged_attention.available(),
                                  reason="no C compiler: the CPU attention kernel cannot be built")
IMPLS = [TorchAttentionImpl, pytest.param(CpuAttentionImpl, marks=needs_kernel)]


def dense_reference(q, k, v, window=None, softcap=None):
    """Causal attention of one whole sequence: q [S, NH, HD], k/v [S, NKV, HD] -> [S, NH, HD];
    a query sees only the last `window` keys given one, scores soft-capped at `softcap`."""
    k = k.repeat_interleave(NH // NKV, dim=1)
    v = v.repeat_interleave(NH // NKV, dim=1)
    s = q.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * HD ** -0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    seen = torch.ones(s, s, dtype=torch.bool).tril()
    if window is not None:
        seen &= ~torch.ones(s, s, dtype=torch.bool).tril(-window)
    scores = scores.masked_fill(~seen, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_steps(lengths_per_step: list[list[int]], total: list[int], num_padding: int = 0,
              impl_cls=TorchAttentionImpl, dtype=torch.float32, stale: float = 0.0,
              window: int | None = None, softcap: float | None = None):
    """Feed random q/k/v for each step; returns the final step's output and expected rows.
    `stale`: what the cache's slots hold before they are written; window, softcap: the
    layer's sliding window and logit soft cap."""
    g = torch.Generator().manual_seed(0)
    seqs = [tuple(torch.randn(n, h, HD, generator=g).to(dtype) for h in (NH, NKV, NKV))
            for n in total]
    impl = impl_cls(NH, HD, HD ** -0.5, NKV, window, softcap)
    cache = torch.full(kv_cache_shape(64, BS, NKV, HD), stale, dtype=dtype)
    pool = BlockPool(64, BS)
    reqs = [PagedRequest(list(range(n))) for n in total]
    for step, q_lens in enumerate(lengths_per_step):
        pad = num_padding if step == len(lengths_per_step) - 1 else 0
        starts = [r.num_computed for r in reqs]
        _, _, md = build_step(pool, reqs, q_lens, num_padding=pad)
        parts = [[t[s:s + n] for t in seq] for seq, s, n in zip(seqs, starts, q_lens)]
        q, k, v = (torch.cat([p[i] for p in parts] + [torch.full((pad,) + parts[0][i].shape[1:],
                                                                  7.0)]) for i in range(3))
        out = torch.empty(q.shape[0], NH * HD, dtype=dtype)
        impl.forward(q.flatten(1), k.flatten(1), v.flatten(1), cache, md, out)
    expected = [dense_reference(*(t.float() for t in seq), window, softcap)[s:s + n]
                for seq, s, n in zip(seqs, starts, q_lens)]
    return out.view(-1, NH, HD), torch.cat(expected), cache, md


@pytest.mark.parametrize("impl_cls", IMPLS)
def test_chunked_and_mixed_match_dense(impl_cls):
    out, expected, _, _ = run_steps([[5, 3, 7], [6, 1, 2]], total=[11, 4, 9], impl_cls=impl_cls)
    assert torch.allclose(out, expected, atol=1e-5)


@pytest.mark.parametrize("impl_cls", IMPLS)
def test_uniform_decode_fast_path_matches_dense(impl_cls):
    out, expected, _, md = run_steps([[6, 13, 2], [1, 1, 1]], total=[7, 14, 3], impl_cls=impl_cls)
    assert md.uniform_decode
    assert torch.allclose(out, expected, atol=1e-5)


# The CPU kernel takes float32 and bfloat16 caches; the torch backend float16 too.
@pytest.mark.parametrize("impl_cls, dtype", [
    (TorchAttentionImpl, torch.float32), (TorchAttentionImpl, torch.float16),
    pytest.param(CpuAttentionImpl, torch.float32, marks=needs_kernel),
    pytest.param(CpuAttentionImpl, torch.bfloat16, marks=needs_kernel)])
@pytest.mark.parametrize("stale", [float("nan"), float("inf")])
def test_stale_slots_past_a_request_never_reach_its_output(impl_cls, stale, dtype):
    # A block's slots past the request's length hold what they held before (here NaN or the
    # inf of a float16 overflow): masked keys must not turn the output into NaN.
    for steps, total in [([[6, 13, 2], [1, 1, 1]], [7, 14, 3]),
                         ([[5, 3, 7], [6, 1, 2]], [11, 4, 9])]:
        out, expected, _, _ = run_steps(steps, total, impl_cls=impl_cls, dtype=dtype,
                                        stale=stale)
        assert torch.allclose(out.float(), expected, atol={torch.float32: 1e-5, torch.float16: 5e-3,
                                                           torch.bfloat16: 3e-2}[dtype])


@needs_kernel
@pytest.mark.parametrize("simd", [True, False], ids=["prefill-kernel", "sdpa"])
def test_cpu_kernels_and_sdpa_share_a_mixed_batch(simd, monkeypatch):
    # Last step: the 70-token query continuing 30 cached tokens goes to the blocked kernel (or,
    # with no SIMD tiles for the layer, to SDPA), the 1- and 3-token ones to the per-token one.
    import kiln.attention.torch_backend as tb
    monkeypatch.setattr(prefill_attention, "simd", lambda dtype, head_size: simd)
    calls, real = [], F.scaled_dot_product_attention
    monkeypatch.setattr(tb.F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out, expected, _, md = run_steps([[30, 2, 70], [70, 1, 3]], total=[100, 3, 73],
                                     impl_cls=CpuAttentionImpl)
    plan = md.step_cache["cpu_split", simd]
    assert plan.short.reqs.tolist() == [1, 2]
    if simd:
        assert plan.prefill.reqs.tolist() == [0] and plan.sdpa == [] and not calls
    else:
        assert plan.prefill is None and plan.sdpa == [0] and calls
    assert torch.allclose(out, expected, atol=1e-5)


@needs_kernel
def test_cpu_kernel_bfloat16_within_rounding():
    out, expected, _, _ = run_steps([[6, 13, 2], [1, 1, 1]], total=[7, 14, 3],
                                    impl_cls=CpuAttentionImpl, dtype=torch.bfloat16)
    ref, _, _, _ = run_steps([[6, 13, 2], [1, 1, 1]], total=[7, 14, 3], dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    # bf16 keeps 8 mantissa bits: outputs of magnitude ~1 round at ~1e-2.
    assert torch.allclose(out.float(), expected, atol=2e-2)
    assert torch.allclose(out.float(), ref.float(), atol=2e-2)


@needs_kernel
def test_cpu_kernel_reads_strided_queries():
    # q arrives as a column slice of the fused qkv projection: rows are not NH*HD apart.
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, (NH + 2 * NKV) * HD, generator=g)
    q, k, v = qkv.split([NH * HD, NKV * HD, NKV * HD], dim=-1)
    pool, reqs = BlockPool(32, BS), [PagedRequest(list(range(5)))]
    _, _, md = build_step(pool, reqs, [5])
    cache = torch.zeros(kv_cache_shape(32, BS, NKV, HD))
    out = torch.empty(5, NH * HD)
    CpuAttentionImpl(NH, HD, HD ** -0.5, NKV).forward(q, k, v, cache, md, out)
    expected = dense_reference(q.reshape(5, NH, HD), k.reshape(5, NKV, HD), v.reshape(5, NKV, HD))
    assert torch.allclose(out.view(5, NH, HD), expected, atol=1e-5)


def test_split_requests_by_query_length():
    assert split_requests([1, 64, 65, 0, 3], max_kernel_len=64) == ([0, 1, 4], [2], [])
    # no SIMD tiles of the blocked kernel for the layer: long queries stay on SDPA
    assert split_requests([1, 64, 65, 0, 3], prefill_kernel=False,
                          max_kernel_len=64) == ([0, 1, 4], [], [2])


@pytest.mark.parametrize("impl_cls", IMPLS)
def test_padding_tokens_write_nothing_and_output_zero(impl_cls):
    out, expected, cache, md = run_steps([[5, 3]], total=[5, 3], num_padding=4,
                                         impl_cls=impl_cls)
    n = md.num_actual_tokens
    assert torch.allclose(out[:n], expected, atol=1e-5)
    assert torch.all(out[n:] == 0)
    assert not torch.any(cache == 7.0)  # the padding rows' k/v never reach the cache


def test_write_kv_cache_skips_negative_slots():
    cache = torch.zeros(kv_cache_shape(2, BS, NKV, HD))
    k = torch.ones(3, NKV, HD)
    write_kv_cache(k, 2 * k, cache, torch.tensor([5, -1, 0]))
    assert cache[0].view(-1, NKV, HD)[[0, 5]].eq(1).all()
    assert cache[1].view(-1, NKV, HD)[[0, 5]].eq(2).all()
    assert cache.view(2, -1, NKV, HD)[:, [1, 2, 3, 4, 6, 7]].eq(0).all()


def test_backend_interface(monkeypatch):
    monkeypatch.setenv("KILN_ATTENTION_BACKEND", "torch")
    backend = get_attn_backend()
    assert backend is TorchAttentionBackend
    assert backend.supports_full_cudagraph is False
    assert backend.get_impl_cls() is TorchAttentionImpl
    assert backend.get_kv_cache_shape(10, 16, 2, 64) == (2, 10, 16, 2, 64)


@needs_kernel
def test_cpu_backend_is_the_cpu_default(monkeypatch):
    monkeypatch.delenv("KILN_ATTENTION_BACKEND", raising=False)
    assert get_attn_backend() is CpuAttentionBackend
    assert CpuAttentionBackend.get_impl_cls() is CpuAttentionImpl
    monkeypatch.setenv("KILN_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match="KILN_ATTENTION_BACKEND='flash' is not one of torch, cpu"):
        get_attn_backend()


class _FakeKilnConfig:
    def __init__(self):
        from kiln.platforms import CpuPlatform

        self.compilation_config = CompilationConfig()
        self.platform = CpuPlatform()


def test_op_traces_under_compile_and_uses_context():
    from kiln.model.layers.attention import Attention, attention_layers

    cfg = _FakeKilnConfig()
    with set_current_kiln_config(cfg):
        layer = Attention(NH, HD, HD ** -0.5, NKV, prefix="layers.0.attn")
    assert attention_layers(layer) == {"layers.0.attn": layer}
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(6, h * HD, generator=g) for h in (NH, NKV, NKV))
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    with set_forward_context(None, cfg, layers=attention_layers(layer)):
        got = compiled(q, k, v)
    ref = F.scaled_dot_product_attention(
        q.view(6, NH, HD).transpose(0, 1), k.view(6, NKV, HD).transpose(0, 1),
        v.view(6, NKV, HD).transpose(0, 1), is_causal=True, enable_gqa=True)
    assert torch.allclose(got, ref.transpose(0, 1).reshape(6, -1), atol=1e-5)


def _assert_decode_matches_dense(nh, nkv, head_size, dtype, lens, seed=0):
    """The CPU impl over a prefill of each request's first n - 1 tokens, then one decode step:
    each request's last token against all its keys, as dense attention gives it."""
    bs = 16
    g = torch.Generator().manual_seed(seed)
    seqs = [tuple(torch.randn(n, h, head_size, generator=g).to(dtype) for h in (nh, nkv, nkv))
            for n in lens]
    pool, reqs = BlockPool(128, bs), [PagedRequest(list(range(n))) for n in lens]
    _, _, md = build_step(pool, reqs, [n - 1 for n in lens])
    cache = torch.zeros(kv_cache_shape(128, bs, nkv, head_size), dtype=dtype)
    impl = CpuAttentionImpl(nh, head_size, head_size ** -0.5, nkv)
    for first, q_lens in ((True, [n - 1 for n in lens]), (False, [1] * len(lens))):
        if not first:
            _, _, md = build_step(pool, reqs, q_lens)
        rows = [slice(n - 1, n) if not first else slice(0, n - 1) for n in lens]
        q, k, v = (torch.cat([seq[i][r] for seq, r in zip(seqs, rows)]) for i in range(3))
        out = torch.empty(q.shape[0], nh * head_size, dtype=dtype)
        impl.forward(q.flatten(1), k.flatten(1), v.flatten(1), cache, md, out)
    k_rep = [s[1].float().repeat_interleave(nh // nkv, 1) for s in seqs]
    v_rep = [s[2].float().repeat_interleave(nh // nkv, 1) for s in seqs]
    for i, seq in enumerate(seqs):  # the decode step: each request's last token sees all keys
        scores = torch.einsum("hd,khd->hk", seq[0][-1].float(), k_rep[i]) * head_size ** -0.5
        expected = torch.einsum("hk,khd->hd", scores.softmax(-1), v_rep[i])
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(out[i].view(nh, head_size).float(), expected, atol=tol)


@needs_kernel
@pytest.mark.parametrize("head_size", [64, 128, 40, 80, 256])  # unrolled; generic; SIMD widths
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nh, nkv", [(6, 2), (8, 1), (4, 4)])  # groups of 3, 8, 1 query heads
def test_cpu_kernel_head_sizes_match_dense(head_size, dtype, nh, nkv):
    _assert_decode_matches_dense(nh, nkv, head_size, dtype, [37, 1, 70], seed=head_size)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nh, nkv, head_size, lens, threads", [
    (9, 3, 64, [700], 2),  # 3 kv heads for 2 threads: each head's keys in 2 parts
    (8, 1, 128, [2, 600], 4),  # 2 items for 4 threads: 4 parts, some empty for the short one
    (4, 2, 40, [300], 2)])  # the scalar loops
def test_long_decodes_split_their_keys_across_threads(dtype, nh, nkv, head_size, lens, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _assert_decode_matches_dense(nh, nkv, head_size, dtype, lens)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_cpu_kernel_refuses_lengths_its_buffers_cannot_hold():
    pool, reqs = BlockPool(32, BS), [PagedRequest(list(range(9)))]
    _, _, md = build_step(pool, reqs, [9])
    cache = torch.zeros(kv_cache_shape(32, BS, NKV, HD))
    q, out = torch.randn(9, NH * HD), torch.empty(9, NH * HD)
    k = v = torch.randn(9, NKV * HD)
    reqs = torch.tensor([0], dtype=torch.int32)

    def run(max_seq_len):
        step = paged_attention.StepArgs(md.block_table, md.query_start_loc, md.seq_lens, reqs,
                                        max_seq_len, BS, md.slot_mapping, 9)
        paged_attention.run(q, k, v, out, cache, step, HD ** -0.5)

    with pytest.raises(RuntimeError, match="code 1: a seq_len above max_seq_len"):
        run(5)  # seq_len 9 > the stated max of 5
    with pytest.raises(ValueError, match="block table's 64 columns"):
        run(64 * BS + 1)
    with pytest.raises(ValueError, match=r"out must be Float \[>= 9, 32\]"):
        paged_attention.run(q, k, v, out[:4], cache, paged_attention.StepArgs(
            md.block_table, md.query_start_loc, md.seq_lens, reqs, 9, BS, md.slot_mapping, 9),
            HD ** -0.5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kv_write_matches_torch_and_refuses_bad_slots(dtype):
    # k and v as the model hands them over: column slices of one qkv row per token.
    qkv = torch.randn(4, (NH + 2 * NKV) * HD).to(dtype)
    q, k, v = qkv.split([NH * HD, NKV * HD, NKV * HD], dim=-1)
    slots = torch.tensor([7, -1, 0, 5])
    expected = torch.zeros(kv_cache_shape(2, BS, NKV, HD), dtype=dtype)
    write_kv_cache(k.view(4, NKV, HD), v.view(4, NKV, HD), expected, slots)
    cache = torch.zeros_like(expected)
    no_reqs = torch.zeros(0, dtype=torch.int32)  # write only

    def write(slot_mapping):
        step = paged_attention.StepArgs(torch.zeros(1, 1, dtype=torch.int32),
                                        torch.zeros(1, dtype=torch.int32),
                                        torch.zeros(0, dtype=torch.int32), no_reqs, 0, BS,
                                        slot_mapping, 4)
        paged_attention.run(q, k, v, torch.empty(4, NH * HD, dtype=dtype), cache, step, 1.0)

    write(slots)
    assert torch.equal(cache, expected)
    with pytest.raises(IndexError, match=r"outside \[-1, 8\)"):
        write(torch.tensor([0, 1, 2, 8]))
    assert torch.equal(cache, expected)  # refused before writing anything
    with pytest.raises(ValueError, match="one slot per token"):
        write(slots[:3])


@pytest.mark.parametrize("impl_cls", IMPLS)
def test_sdpa_gets_batched_inputs(impl_cls, monkeypatch):
    # CPU torch runs 3-D SDPA inputs on its math path, 3-6x slower than the flash kernel it
    # picks for 4-D ones (measured); every SDPA call here must hand over a batch dim. (The CPU
    # backend's long queries reach SDPA where the blocked kernel has no SIMD tiles.)
    import kiln.attention.torch_backend as tb
    monkeypatch.setattr(prefill_attention, "simd", lambda dtype, head_size: False)
    dims, real = [], F.scaled_dot_product_attention
    monkeypatch.setattr(tb.F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: dims.append((q.dim(), k.dim())) or real(q, k, v, **kw))
    out, expected, _, _ = run_steps([[40, 3], [40, 40]], total=[80, 43], impl_cls=impl_cls)
    assert torch.allclose(out, expected, atol=1e-5)
    assert dims and set(dims) == {(4, 4)}


@needs_kernel
def test_cpu_impl_gathers_metadata_once_per_step_and_keeps_no_cache(monkeypatch):
    counts = {"StepArgs": 0}
    for name in counts:
        real = getattr(paged_attention, name)
        monkeypatch.setattr(paged_attention, name, lambda *a, _n=name, _r=real: counts.update(
            {_n: counts[_n] + 1}) or _r(*a))
    g = torch.Generator().manual_seed(0)
    layers = [[CpuAttentionImpl(NH, HD, HD ** -0.5, NKV),
               torch.zeros(kv_cache_shape(64, BS, NKV, HD))] for _ in range(3)]
    dense = [torch.zeros(kv_cache_shape(64, BS, NKV, HD)) for _ in layers]
    pool = BlockPool(64, BS)
    reqs = [PagedRequest(list(range(8))), PagedRequest(list(range(8)))]
    for step, q_lens in enumerate([[5, 3], [1, 1], [1, 1]]):
        if step == 2:  # a layer's cache replaced by a copy: the impl does not keep the old one
            replaced = weakref.ref(layers[0][1])
            layers[0][1] = layers[0][1].clone()
            assert replaced() is None
        _, _, md = build_step(pool, reqs, q_lens)
        tokens = sum(q_lens)
        for (impl, cache), reference_cache in zip(layers, dense):
            q, k, v = (torch.randn(tokens, h * HD, generator=g) for h in (NH, NKV, NKV))
            out, want = torch.empty(tokens, NH * HD), torch.empty(tokens, NH * HD)
            impl.forward(q, k, v, cache, md, out)
            TorchAttentionImpl(NH, HD, HD ** -0.5, NKV).forward(q, k, v, reference_cache, md, want)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert counts == {"StepArgs": 3}


def test_the_layer_table_refuses_a_duplicate_name():
    from kiln.model.layers.attention import Attention, attention_layers

    with set_current_kiln_config(_FakeKilnConfig()):
        layers = torch.nn.ModuleList(Attention(NH, HD, HD ** -0.5, NKV, prefix="layers.0.attn")
                                     for _ in range(2))
    with pytest.raises(ValueError, match="duplicate attention layer name 'layers.0.attn'"):
        attention_layers(layers)
