"""The figures `vllm bench` writes, under vLLM's names, beside Kiln's own in each report, so a
script that reads vLLM's result JSON (requests_per_second, output_throughput, p99_ttft_ms, ...)
reads Kiln's too. Values unrounded, times in ms, as vLLM writes them.
"""
import statistics

# vLLM's defaults: --metric-percentiles 99 of --percentile-metrics ttft,tpot,itl (e2el too,
# named when asked; Kiln always reports it).
_METRICS = ("ttft", "tpot", "itl", "e2el")
_PERCENTILES = (99,)


def throughput_fields(elapsed_s: float, num_requests: int, num_prompt_tokens: int,
                      num_output_tokens: int, prefix: str = "") -> dict:
    """`vllm bench throughput --output-json`'s fields (tokens: prompt and output together)."""
    total = num_prompt_tokens + num_output_tokens
    return {f"{prefix}elapsed_time": elapsed_s, f"{prefix}num_requests": num_requests,
            f"{prefix}total_num_tokens": total,
            f"{prefix}requests_per_second": num_requests / elapsed_s,
            f"{prefix}tokens_per_second": total / elapsed_s}


def percentile(sorted_values: list[float], q: float) -> float:
    """numpy's default (linear) percentile of sorted values; 0 for none."""
    if not sorted_values:
        return 0.0
    pos = (len(sorted_values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def serve_fields(completed: list, duration: float) -> dict:
    """`vllm bench serve`'s result fields for `completed` (RequestResults that succeeded):
    throughputs, then mean/median/std/p99 of each metric in ms. TPOT is a request's time per
    output token after the first, (latency - ttft) / (tokens - 1), which holds when a stream
    chunk carries several tokens; ITL is the gap between chunks, as vLLM measures it."""
    total_in = sum(r.prompt_tokens for r in completed)
    total_out = sum(r.output_tokens for r in completed)
    out = {"duration": duration, "total_input_tokens": total_in,
           "request_throughput": len(completed) / duration if duration else 0.0,
           "output_throughput": total_out / duration if duration else 0.0,
           "total_token_throughput": (total_in + total_out) / duration if duration else 0.0}
    samples = {"ttft": [r.ttft for r in completed],
               "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1)
                        for r in completed if r.output_tokens > 1],
               "itl": [g for r in completed for g in r.itls],
               "e2el": [r.latency for r in completed]}
    for name in _METRICS:
        ms = sorted(v * 1000 for v in samples[name])
        out[f"mean_{name}_ms"] = statistics.fmean(ms) if ms else 0.0
        out[f"median_{name}_ms"] = statistics.median(ms) if ms else 0.0
        out[f"std_{name}_ms"] = statistics.pstdev(ms) if ms else 0.0  # numpy's std
        for q in _PERCENTILES:
            out[f"p{q}_{name}_ms"] = percentile(ms, q)
    return out
