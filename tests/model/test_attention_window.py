"""Sliding windows and logit soft caps in the attention backends (torch; CPU: its Python paths
and the C++ op's layer table), checked against a dense masked softmax without a model; then
through a whole Gemma-2 against HF's eager attention over chunked prefills and decodes past the
window."""
import pytest
import torch

from kiln.attention.cpu_backend import CpuAttentionImpl
from kiln.attention.masking import first_key, key_mask
from kiln.attention.torch_backend import TorchAttentionImpl
from kiln.native import attention_op
from model.test_attention_backend import HD, IMPLS, NH, NKV, dense_reference, run_steps

# (steps' query lengths, requests' total lengths): chunks beside decodes, one uniform-decode
# step, long queries (the CPU backend's blocked kernel) continuing a cached context
STEPS = {"mixed": ([[5, 3, 7], [6, 1, 2]], [11, 4, 9]), "decode": ([[6, 13, 2], [1, 1, 1]],
                                                                     [7, 14, 3]),
         "long": ([[12, 3], [20, 9]], [32, 12])}


def test_window_mask_decisions():
    assert [first_key(p, 3) for p in (0, 2, 3, 9)] == [0, 0, 1, 7]
    assert first_key(9, None) == 0
    mask = key_mask(torch.tensor([4, 5]), torch.arange(7), 2)
    assert mask.tolist() == [[False, False, False, True, True, False, False],
                             [False, False, False, False, True, True, False]]


@pytest.mark.parametrize("impl_cls", IMPLS)
@pytest.mark.parametrize("window, softcap", [(3, None), (5, 1.5), (None, 0.7), (1, None)])
@pytest.mark.parametrize("steps", list(STEPS))
def test_backends_window_and_softcap_match_dense(impl_cls, window, softcap, steps):
    lengths, total = STEPS[steps]
    out, expected, _, _ = run_steps(lengths, total, impl_cls=impl_cls, window=window,
                                    softcap=softcap)
    assert torch.allclose(out, expected, atol=1e-5)


@pytest.mark.parametrize("impl_cls", IMPLS)
def test_warm_up_batch_keeps_the_window(impl_cls):
    """No metadata (warm-up, profiling): the batch is one causal sequence, windowed too."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(10, h, HD, generator=g) for h in (NH, NKV, NKV))
    impl = impl_cls(NH, HD, HD ** -0.5, NKV, 4, 2.0)
    out = torch.empty(10, NH * HD)
    impl.forward(q.flatten(1), k.flatten(1), v.flatten(1), None, None, out)
    assert torch.allclose(out.view(10, NH, HD), dense_reference(q, k, v, 4, 2.0), atol=1e-5)


LAYERS = [(None, None), (3, None), (5, 1.5)]  # (window, soft cap): full, windowed, both


@pytest.mark.skipif(not attention_op.available(), reason="no C/C++ compiler")
def test_cpp_op_takes_each_layers_window_and_softcap():
    """Decode steps handed to the C++ op: its layer table carries each layer's window and soft
    cap (full, windowed and capped layers side by side), as the torch backend computes them."""
    from kiln.attention.cpu_backend import CpuAttentionBackend
    from kiln.forward_context import set_forward_context
    from model._attn_helper import build_step
    from model.test_cpu_attention_op import HD, NH, NKV, Engine, assert_same

    engine = Engine(num_layers=3)
    for layer, (window, cap) in zip(engine.layers, LAYERS):
        assert isinstance(layer.impl, CpuAttentionImpl)
        layer.impl.sliding_window, layer.impl.logits_soft_cap = window, cap
    engine.step([9, 7])  # the contexts, past the windows once decoding
    for _ in range(2):
        _, _, md = build_step(engine.pool, engine.reqs, [1, 1])
        before = attention_op.call_counts()
        outs, wants = [], []
        with set_forward_context(md, engine.cfg, layers=engine.table):
            CpuAttentionBackend.begin_step(md, engine.layers[0].kv_cache.shape[2])
            for layer, cache, (window, cap) in zip(engine.layers, engine.reference, LAYERS):
                q, k, v = (torch.randn(2, h * HD, generator=engine.g) for h in (NH, NKV, NKV))
                outs.append(layer(q, k, v))
                want = torch.empty_like(q)
                TorchAttentionImpl(NH, HD, HD ** -0.5, NKV, window, cap).forward(
                    q, k, v, cache, md, want)
                wants.append(want)
        assert attention_op.call_counts()["kernel"] - before["kernel"] == 3
        assert_same(outs, wants)


def _chunked_logits_diff(path, backend: str, chunks, monkeypatch) -> float:
    """Kiln's logits over `chunks` of one 40-token sequence (prefill chunks, then decodes)
    against HF eager's over the whole, max abs diff."""
    from transformers import AutoModelForCausalLM

    from kiln.model.loader import get_model
    from model._attn_helper import (
        BlockPool,
        PagedRequest,
        allocate_kv_caches,
        build_step,
        kiln_config_for,
        run_step,
    )

    monkeypatch.setenv("KILN_ATTENTION_BACKEND", backend)
    cfg = kiln_config_for(path, max_model_len=128)
    model = get_model(cfg)
    allocate_kv_caches(model, cfg, 64, 4)
    seq = torch.randint(3, 512, (sum(chunks),), generator=torch.Generator().manual_seed(1)).tolist()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0]  # [S, V]
    pool, req = BlockPool(64, 4), PagedRequest(seq)
    got = [run_step(model, cfg, *build_step(pool, [req], [n])) for n in chunks]
    return (torch.cat(got) - ref).abs().max().item()


CHUNKS = (20, 9, 1, 1, 3, 1, 1, 1, 1, 1, 1)  # 40 tokens: a long and a short chunk, decodes


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_gemma2_matches_hf_eager_past_the_window(backend, tmp_path, monkeypatch):
    """Eager Gemma-2 (sliding, global, sliding layers; both soft caps) per backend; Qwen2's
    full and windowed layers are checked in test_model_configs_vs_hf.py."""
    from model.test_model_configs_vs_hf import make_checkpoint

    path = make_checkpoint(tmp_path / "m", "Gemma2Config", sliding_window=8, head_dim=16,
                           num_hidden_layers=3, query_pre_attn_scalar=24,
                           attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                           pad_token_id=0)
    assert _chunked_logits_diff(path, backend, CHUNKS, monkeypatch) < 1e-4  # measured 3e-6



@pytest.mark.parametrize("impl_cls", IMPLS)
@pytest.mark.parametrize("window", [1, 5, 9])
def test_decode_reads_only_the_windows_blocks(impl_cls, window):
    """Blocks wholly before a decoding query's window may be back in the pool (the KV cache frees
    them when every layer is windowed): their table slots name a block of NaNs, which a read
    (even masked: 0 * NaN) would spread into the output."""
    from model._attn_helper import BlockPool, PagedRequest, build_step
    from model.test_attention_backend import BS

    total = [23, 9, 30]
    g = torch.Generator().manual_seed(5)
    seqs = [tuple(torch.randn(n, h, HD, generator=g) for h in (NH, NKV, NKV)) for n in total]
    impl = impl_cls(NH, HD, HD ** -0.5, NKV, window)
    cache = torch.zeros(2, 64, BS, NKV, HD)
    pool, poisoned = BlockPool(63, BS), 63
    cache[:, poisoned] = float("nan")
    reqs = [PagedRequest(list(range(n))) for n in total]
    for q_lens in ([n - 1 for n in total], [1] * len(total)):  # prefill, then one decode
        starts = [r.num_computed for r in reqs]
        _, _, md = build_step(pool, reqs, q_lens)
        if q_lens[0] == 1:
            assert md.uniform_decode
            for i, n in enumerate(total):  # the blocks behind this query's window: freed
                md.block_table[i, :first_key(n - 1, window) // BS] = poisoned
        q, k, v = (torch.cat([seq[j][s:s + n] for seq, s, n in zip(seqs, starts, q_lens)])
                   for j in range(3))
        out = torch.empty(q.shape[0], NH * HD)
        impl.forward(q.flatten(1), k.flatten(1), v.flatten(1), cache, md, out)
    expected = torch.stack([dense_reference(*seq, window)[-1] for seq in seqs])
    assert torch.allclose(out.view(-1, NH, HD), expected, atol=1e-5)
