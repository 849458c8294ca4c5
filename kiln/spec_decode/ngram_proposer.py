"""vLLM's NgramProposer as a pure function: find the request's last n tokens (n from
prompt_lookup_max down to prompt_lookup_min) earlier in its tokens, and propose what followed.

The search looks only at the places holding the last token, and extends each match backwards
at most max_n tokens: O(tokens) once plus O(places x max_n), not O(tokens x max_n) per n (the
scheduler runs it for every decoding request at every step)."""
import numpy as np


def propose_ngram(token_ids, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` draft tokens for a sequence `token_ids` (prompt + output): for the longest
    suffix of length in [min_n, max_n] that occurs earlier (its earliest occurrence, as vLLM's
    KMP search picks), the tokens after that occurrence; [] when none matches."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    total = tokens.size
    if k <= 0 or total < min_n + 1:
        return []
    # where earlier occurrences could end: every place but the last holding the last token
    ends = np.flatnonzero(tokens[:total - 1] == tokens[total - 1])
    if ends.size == 0:
        return []
    length = np.ones(ends.size, dtype=np.int64)  # how far each matches the suffix backwards
    alive = np.ones(ends.size, dtype=bool)
    for m in range(1, min(max_n, total - 1)):
        idx = ends - m
        alive &= idx >= 0
        alive[alive] = tokens[idx[alive]] == tokens[total - 1 - m]
        if not alive.any():
            break
        length += alive
    best = int(length.max())
    if best < min_n:
        return []
    start = int(ends[np.argmax(length >= best)]) + 1  # the earliest of the longest
    return tokens[start:start + k].tolist()
