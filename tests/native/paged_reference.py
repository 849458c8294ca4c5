"""What the paged-attention kernel tests share: shuffled block tables over a cache, and the float64
softmax each request's queries are checked against."""
import random

import torch


def shuffled_block_tables(seq_lens: list[int], bs: int, rnd: random.Random,
                          spare: int = 3) -> tuple[list[list[int]], torch.Tensor, int]:
    """(each request's block ids, in shuffled order; the int32 block table, one column more than
    the longest needs; the cache's block count, `spare` blocks that no request owns)."""
    per_req = [-(-s // bs) for s in seq_lens]
    ids = list(range(sum(per_req) + spare))
    rnd.shuffle(ids)
    tables = [ids[sum(per_req[:r]):sum(per_req[:r + 1])] for r in range(len(seq_lens))]
    block_table = torch.zeros(len(seq_lens), max(per_req) + 1, dtype=torch.int32)
    for r, table in enumerate(tables):
        block_table[r, :len(table)] = torch.tensor(table, dtype=torch.int32)
    return tables, block_table, len(ids)


def reference_attention(q, kc, vc, tables, starts, seq_lens, nh, nkv, hd, bs, scale,
                        reqs=None, window=None, softcap=None) -> dict[int, torch.Tensor]:
    """Token index -> its float64 attention output [nh * hd] for the requests `reqs` (default:
    all): query t of request r sits at the end of its context and sees the keys up to its own
    position (only the last `window` of them, given one), read from the cache halves kc / vc
    [nb, bs, nkv, hd] through `tables`; scores soft-capped at `softcap` (cap * tanh(s / cap))."""
    out = {}
    for r in range(len(tables)) if reqs is None else reqs:
        slots = [tables[r][s // bs] * bs + s % bs for s in range(seq_lens[r])]
        k = kc.reshape(-1, nkv, hd)[slots].double().repeat_interleave(nh // nkv, 1)
        v = vc.reshape(-1, nkv, hd)[slots].double().repeat_interleave(nh // nkv, 1)
        for t in range(starts[r], starts[r + 1]):
            n = seq_lens[r] - (starts[r + 1] - t) + 1  # causal: up to its own position
            lo = 0 if window is None else max(0, n - window)
            s = torch.einsum("hd,nhd->hn", q[t].double().view(nh, hd), k[lo:n]) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            out[t] = torch.einsum("hn,nhd->hd", s.softmax(-1), v[lo:n]).reshape(-1)
    return out
