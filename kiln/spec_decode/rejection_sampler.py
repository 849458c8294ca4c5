"""vLLM's rejection sampler for a deterministic (one-hot) draft, as n-gram and greedy draft-model
drafts are.

A request with k drafts has k + 1 rows of logits: row j predicts the token after draft j - 1.
Every row goes through the request's own logit edits (Sampler.process, with the tokens before
that position) and, for random requests, temperature and min-p / top-k / top-p (Sampler.probs).
Draft j is accepted with probability p_j(d_j) (greedy: when it is the row's argmax); at the
first rejection the token is drawn from p_j with d_j removed and renormalised, which keeps the
output distributed exactly as p_j; when all k are accepted, a bonus token is drawn from p_k.
"""
import torch

from kiln.sample.inverse_cdf import inverse_cdf
from kiln.sample.row_reductions import row_argmax
from kiln.sample.sampler import Sampler
from kiln.sample.sampling_metadata import SamplingMetadata


def draw_uniforms(num_rows: list[int], greedy: list[bool],
                  generators: list[torch.Generator | None],
                  default_generator: torch.Generator | None, device) -> torch.Tensor:
    """[sum(num_rows)] float64 uniforms, request i's rows from its own generator when seeded
    (k + 1 numbers a step whatever is accepted, so a seeded request repeats itself); greedy
    requests draw none."""
    u = torch.zeros(sum(num_rows), dtype=torch.float64, device=device)
    shared = []  # rows of unseeded random requests: one draw from the engine's generator
    start = 0
    for n, g, gen in zip(num_rows, greedy, generators):
        if not g:
            if gen is not None:
                u[start:start + n].uniform_(generator=gen)
            else:
                shared.extend(range(start, start + n))
        start += n
    if shared:
        drawn = torch.empty(len(shared), dtype=torch.float64, device=device)
        drawn.uniform_(generator=default_generator)
        u[torch.tensor(shared, dtype=torch.int64, device=device)] = drawn
    return u


def rejection_sample(sampler: Sampler, logits: torch.Tensor, meta: SamplingMetadata,
                     drafts: list[list[int]], greedy: list[bool], uniforms: torch.Tensor
                     ) -> tuple[list[list[int]], torch.Tensor, torch.Tensor | None]:
    """logits [sum(len(d) + 1), V], rows request after request; meta: per row. Returns each
    request's emitted tokens (accepted drafts, then one sampled token), the token at every row
    ([rows] int64: what that position emitted, for its logprobs) and the rows' raw logprobs
    (None when no row asked for logprobs)."""
    logits, raw_logprobs, _ = sampler.process(logits, meta)
    num_rows = logits.shape[0]
    device = logits.device
    starts, draft_rows, draft_cols = [], [], []
    row = 0
    for d in drafts:
        starts.append(row)
        draft_rows.extend(range(row, row + len(d)))
        draft_cols.extend(d)
        row += len(d) + 1
    draft_at = torch.zeros(num_rows, dtype=torch.int64, device=device)
    d_rows = torch.tensor(draft_rows, dtype=torch.int64, device=device)
    draft_at[d_rows] = torch.tensor(draft_cols, dtype=torch.int64, device=device)

    argmax = row_argmax(logits)
    final = argmax
    accept = argmax == draft_at
    if not meta.all_greedy:
        probs = Sampler.probs(logits, meta)  # [rows, V]
        p_draft = probs.gather(1, draft_at.unsqueeze(1)).squeeze(1)
        # the residual distribution max(p - q, 0) for a one-hot q: p without the draft
        residual = probs.clone()
        residual[d_rows, draft_at[d_rows]] = 0.0
        # a draft holding all the mass (p = 1) is always accepted; keep its row drawable
        spent = residual.sum(dim=1) <= 0
        residual[spent] = probs[spent]
        # one uniform per request for its final draw: its last row's
        last = torch.tensor([s + len(d) for s, d in zip(starts, drafts)], device=device)
        per_row_last = torch.repeat_interleave(
            last, torch.tensor([len(d) + 1 for d in drafts], device=device))
        u_final = uniforms[per_row_last]
        sampled = inverse_cdf(residual, u_final)
        greedy_rows = torch.repeat_interleave(
            torch.tensor(greedy, dtype=torch.bool, device=device),
            torch.tensor([len(d) + 1 for d in drafts], device=device))
        final = torch.where(greedy_rows, argmax, sampled)
        accept = torch.where(greedy_rows, accept, uniforms < p_draft.double())

    accept_l, final_l = accept.tolist(), final.tolist()
    emitted: list[list[int]] = []
    row_tokens = list(final_l)
    for start, d in zip(starts, drafts):
        n = 0
        while n < len(d) and accept_l[start + n]:
            row_tokens[start + n] = d[n]
            n += 1
        emitted.append(list(d[:n]) + [final_l[start + n]])
    return emitted, torch.tensor(row_tokens, dtype=torch.int64, device=device), raw_logprobs
