"""Folds the engine's DELTA outputs into CUMULATIVE ones: text, tokens and logprobs per sample.

Pure functions on `RequestOutput`s, so `AsyncLLM` can always ask the engine for deltas.
"""
from kiln.outputs import CompletionOutput, RequestOutput


def num_new_tokens(delta: RequestOutput) -> int:
    """Tokens a DELTA output carries, over all its samples."""
    return sum(len(o.token_ids) for o in delta.outputs)


def _merge_sample(acc: CompletionOutput | None, d: CompletionOutput) -> CompletionOutput:
    if acc is None:
        return CompletionOutput(index=d.index, text=d.text, token_ids=list(d.token_ids),
                                cumulative_logprob=d.cumulative_logprob,
                                logprobs=None if d.logprobs is None else list(d.logprobs),
                                finish_reason=d.finish_reason, stop_reason=d.stop_reason)
    if d.logprobs is None:
        logprobs = acc.logprobs
    else:
        logprobs = (acc.logprobs or []) + list(d.logprobs)
    return CompletionOutput(
        index=d.index, text=acc.text + d.text, token_ids=acc.token_ids + list(d.token_ids),
        cumulative_logprob=(d.cumulative_logprob if d.cumulative_logprob is not None
                            else acc.cumulative_logprob),
        logprobs=logprobs, finish_reason=d.finish_reason or acc.finish_reason,
        stop_reason=d.stop_reason if d.stop_reason is not None else acc.stop_reason)


def merge_delta(acc: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """A new RequestOutput = `acc` + `delta` (neither is modified; samples ordered by index)."""
    samples = {o.index: o for o in acc.outputs} if acc is not None else {}
    for d in delta.outputs:
        samples[d.index] = _merge_sample(samples.get(d.index), d)
    return RequestOutput(
        request_id=delta.request_id,
        prompt=delta.prompt if delta.prompt is not None else (acc.prompt if acc else None),
        prompt_token_ids=(delta.prompt_token_ids or (acc.prompt_token_ids if acc else []) or []),
        outputs=[samples[i] for i in sorted(samples)],
        finished=delta.finished,
        num_cached_tokens=max(delta.num_cached_tokens, acc.num_cached_tokens if acc else 0))
