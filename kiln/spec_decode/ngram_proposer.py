"""vLLM's NgramProposer as a pure function: find the request's last n tokens (n from
prompt_lookup_max down to prompt_lookup_min) earlier in its tokens, and propose what followed."""
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` draft tokens for a sequence `token_ids` (prompt + output): for the longest
    suffix of length in [min_n, max_n] that occurs earlier (its earliest occurrence, as vLLM's
    KMP search picks), the tokens after that occurrence; [] when none matches."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    total = tokens.size
    if k <= 0 or total < min_n + 1:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n:]
        # windows starting at 0 .. total - n - 1: every occurrence but the suffix itself
        windows = sliding_window_view(tokens[:total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return tokens[start:start + k].tolist()
    return []
