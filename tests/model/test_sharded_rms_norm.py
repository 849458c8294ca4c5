"""OLMo-2/3's whole-projection q / k norms split over tensor-parallel ranks (they were refused
at tp > 1): each rank's share of the row, its mean square summed over the ranks, equals the
one-rank norm; KV heads replicated over more ranks than heads too."""
import pytest
import torch

from kiln.model.layers import sharded_rms_norm
from kiln.model.layers.linear import QKVParallelLinear


@pytest.mark.parametrize("tp_size, kv_heads", [(2, 2), (4, 2), (4, 1)])
def test_sharded_whole_projection_norm_equals_one_rank(tp_size, kv_heads, monkeypatch):
    heads, head_dim, eps = 4, 8, 1e-6
    g = torch.Generator().manual_seed(0)
    one = QKVParallelLinear(32, head_dim, heads, kv_heads, False, tp_rank=0, tp_size=1)
    q_ref, k_ref = sharded_rms_norm.whole_projection_norms(one, eps)
    weights = {"q": torch.randn(heads * head_dim, generator=g),
               "k": torch.randn(kv_heads * head_dim, generator=g)}
    rows = {"q": torch.randn(3, heads * head_dim, generator=g),
            "k": torch.randn(3, kv_heads * head_dim, generator=g)}
    q_ref.weight.data.copy_(weights["q"])
    k_ref.weight.data.copy_(weights["k"])
    want = {"q": q_ref(rows["q"]), "k": k_ref(rows["k"])}
    ranks = [QKVParallelLinear(32, head_dim, heads, kv_heads, False, tp_rank=r, tp_size=tp_size)
             for r in range(tp_size)]
    for which in ("q", "k"):
        norms = [dict(zip("qk", sharded_rms_norm.whole_projection_norms(p, eps)))[which]
                 for p in ranks]
        for norm in norms:
            norm.weight.weight_loader(norm.weight, weights[which])
        shares = [rows[which].narrow(1, n.shard * n.size, n.size) for n in norms]
        # the all-reduce: every rank's mean square summed (replicated heads counted per rank)
        total = sum(s.pow(2).mean(-1, keepdim=True) for s in shares)
        monkeypatch.setattr(sharded_rms_norm, "tensor_model_parallel_all_reduce",
                            lambda x, total=total: total)
        # each shard once (replicas give the same output), in head order
        got = torch.cat([n(s) for i, (n, s) in enumerate(zip(norms, shares))
                         if all(m.shard != n.shard for m in norms[:i])], dim=1)
        torch.testing.assert_close(got, want[which], atol=1e-6, rtol=1e-5)
