"""vLLM's periodic "SpecDecoding metrics:" log line, logged after the stats line: acceptance
length, accepted / drafted throughput and per-position acceptance over the window, from the
engine's spec_decode_* totals (kiln/core/stats.py); none without speculation or drafts.
"""


def spec_totals(engine_stats: dict) -> tuple[int, int, int, tuple[int, ...]]:
    """(drafts, draft tokens, accepted tokens, accepted per position) totals since start."""
    return (engine_stats.get("spec_decode_num_drafts", 0),
            engine_stats.get("spec_decode_num_draft_tokens", 0),
            engine_stats.get("spec_decode_num_accepted_tokens", 0),
            tuple(engine_stats.get("spec_decode_num_accepted_tokens_per_pos") or ()))


def spec_decoding_line(now: tuple, then: tuple | None, elapsed: float) -> str | None:
    """The line for the window between two spec_totals (`then` None: since start), None where
    the window ran no drafts (vLLM logs none then; nor without --speculative-config, whose
    totals have no positions)."""
    drafts, draft_tokens, accepted, per_pos = now
    if not per_pos:
        return None
    if then is not None and len(then[3]) == len(per_pos):
        drafts, draft_tokens, accepted = drafts - then[0], draft_tokens - then[1], \
            accepted - then[2]
        per_pos = tuple(a - b for a, b in zip(per_pos, then[3]))
    if drafts <= 0:
        return None
    rate = 100 * accepted / draft_tokens if draft_tokens else float("nan")
    per_second = (lambda n: n / elapsed) if elapsed > 0 else (lambda n: 0.0)
    # acceptance length counts the token sampled after the accepted drafts, as vLLM's
    return ("SpecDecoding metrics: "
            f"Mean acceptance length: {1 + accepted / drafts:.2f}, "
            f"Accepted throughput: {per_second(accepted):.2f} tokens/s, "
            f"Drafted throughput: {per_second(draft_tokens):.2f} tokens/s, "
            f"Accepted: {accepted} tokens, Drafted: {draft_tokens} tokens, "
            "Per-position acceptance rate: "
            f"{', '.join(f'{n / drafts:.3f}' for n in per_pos)}, "
            f"Avg Draft acceptance rate: {rate:.1f}%")
