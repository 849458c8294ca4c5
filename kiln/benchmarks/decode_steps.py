"""Timed decode steps of LLMEngine.step for the latency benchmark: a batch started and warmed
up, steps timed (in turns when interleaved), their times summarized in milliseconds.
"""
import math
import statistics
import time


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated q-th percentile (0..100) of a non-empty list."""
    data = sorted(values)
    pos = (len(data) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def summarize_ms(seconds: list[float]) -> dict:
    ms = [s * 1000 for s in seconds]
    # Unrounded, so ratios computed from the report equal the report's own ratios.
    return {"median_ms": statistics.median(ms), "p90_ms": percentile(ms, 90),
            "mean_ms": statistics.fmean(ms), "min_ms": min(ms), "max_ms": max(ms),
            "num_steps": len(ms)}


def check_decode_step(outs, batch_size: int, what: str) -> None:
    tokens = [len(o.outputs[0].token_ids) for o in outs if o.outputs]
    if len(outs) != batch_size or tokens != [1] * batch_size or any(o.finished for o in outs):
        raise RuntimeError(f"{what}: expected {batch_size} requests each decoding one token, got "
                           f"{len(outs)} outputs with {tokens} new tokens (preempted or finished "
                           "early?); raise --kv-cache-memory or --max-model-len")


STEPS_PER_TURN = 4  # interleaved runs: timed steps each engine takes per turn


def turn_lengths(num_steps: int, per_turn: int = STEPS_PER_TURN) -> list[int]:
    """num_steps cut into turns of per_turn (the last may be shorter)."""
    return [min(per_turn, num_steps - i) for i in range(0, num_steps, per_turn)]


def start_batch(engine, prompts: list[list[int]], warmup_steps: int, max_tokens: int,
                tag: str, temperature: float = 0.0) -> list[str]:
    """Add the prompts, step until every one has its first token, then `warmup_steps` untimed
    decode steps; returns the request ids (abort them when done)."""
    from kiln.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=max_tokens,
                            output_kind=RequestOutputKind.DELTA)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    try:
        started: set[str] = set()
        for _ in range(sum(map(len, prompts)) + 1):  # a prefill step computes >= 1 token
            started.update(o.request_id for o in engine.step()
                           if o.outputs and o.outputs[0].token_ids)
            if len(started) == len(prompts):
                break
        else:
            raise RuntimeError(f"{tag}: prefill did not finish for every request")
        for i in range(warmup_steps):
            check_decode_step(engine.step(), len(prompts), f"{tag} warm-up step {i}")
    except BaseException:
        engine.abort_request(ids)
        raise
    return ids


def time_steps(engine, num_steps: int, batch_size: int, tag: str) -> list[float]:
    """Seconds per LLMEngine.step for num_steps steps in which every request decodes one token."""
    times = []
    for i in range(num_steps):
        start = time.perf_counter()
        outs = engine.step()  # returns sampled tokens on the host: the step has finished
        times.append(time.perf_counter() - start)
        check_decode_step(outs, batch_size, f"{tag} step {i}")
    return times


def measure_batch(engine, prompts: list[list[int]], num_steps: int, warmup_steps: int,
                  max_tokens: int, tag: str) -> list[float]:
    """Seconds per LLMEngine.step for `num_steps` steps in which every prompt decodes one token."""
    ids = start_batch(engine, prompts, warmup_steps, max_tokens, tag)
    try:
        return time_steps(engine, num_steps, len(prompts), tag)
    finally:
        engine.abort_request(ids)
