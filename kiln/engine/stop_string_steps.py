"""Stop strings over a step that brought several tokens (speculative decoding's accepted
drafts): the tokens are detokenized one at a time, as steps of one token each would, and the
request ends at the token whose text completes a stop string. The tokens after it are no
output: without the drafts they would never have been sampled."""


def update_until_stop(detokenizer, token_ids: list[int], final: bool,
                      stop_terminated: bool) -> tuple[str | None, int]:
    """detokenizer.update over `token_ids`: (the stop string found or None, how many of the
    tokens the output keeps). `final` / `stop_terminated` are those of the step's last token."""
    if not getattr(detokenizer, "stop", None) or len(token_ids) <= 1:
        return detokenizer.update(token_ids, final=final, stop_terminated=stop_terminated), \
            len(token_ids)
    last = len(token_ids) - 1
    for i, token in enumerate(token_ids):
        hit = detokenizer.update([token], final=final and i == last,
                                 stop_terminated=stop_terminated and i == last)
        if hit is not None:
            return hit, i + 1
    return None, len(token_ids)
