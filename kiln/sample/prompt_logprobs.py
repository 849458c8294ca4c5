"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): for every prompt token after the
first, its log-probability given the tokens before it, its rank, and the top-N alternatives.

A step that runs prompt positions [start, end) of a request has, in the hidden state at position
p, the prediction of prompt token p + 1; chunked prefills deliver them a chunk per step.
"""
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kiln.core.outputs import LogprobsLists
from kiln.sample.logprobs import gather_logprobs, to_logprobs_lists
from kiln.sample.nonfinite import finite_log_softmax

# Bytes of float32 logits made at once. A 2048-token prompt chunk with a 150k vocabulary would
# otherwise take 1.2 GB. Under glibc's largest mmap threshold (32 MiB), the logits and their
# log_softmax can reuse freed heap memory; above it each chunk maps (and page-faults) fresh
# memory, which made a chunk's log_softmax several times slower in the engine than alone
# (figures: docs/measurements.md).
LOGITS_BYTES_PER_CHUNK = 24 << 20


def rows_per_chunk(vocab_size: int) -> int:
    """Prompt positions whose logits are made at once."""
    return max(1, LOGITS_BYTES_PER_CHUNK // (4 * vocab_size))


@dataclass
class PromptLogprobsChunk:
    """Entries for prompt tokens start + 1 .. start + len(entries) (one per predicted token)."""
    start: int  # position of the first hidden state used; predicts prompt token start + 1
    entries: list[LogprobsLists]


def predicting_positions(num_computed: int, num_scheduled: int, num_prompt: int) -> range:
    """Positions run this step whose hidden state predicts a prompt token (p -> token p + 1)."""
    return range(num_computed, min(num_computed + num_scheduled, num_prompt - 1))


def compute_prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                            hidden: torch.Tensor, targets: list[int], num_logprobs: int,
                            vocab_size: int) -> list[LogprobsLists]:
    """One entry per row of hidden [P, H]: the target token's logprob and rank, then the top
    num_logprobs, from the raw distribution (as sampled-token logprobs are)."""
    out: list[LogprobsLists] = []
    step = rows_per_chunk(vocab_size)
    for lo in range(0, hidden.shape[0], step):
        rows = hidden[lo:lo + step]
        logprobs = finite_log_softmax(compute_logits(rows).float())  # [rows, V]
        target = torch.tensor(targets[lo:lo + step], dtype=torch.int64,
                              device=logprobs.device)
        ids, lps, ranks = gather_logprobs(logprobs, target, num_logprobs)
        out += to_logprobs_lists(ids, lps, ranks, [num_logprobs] * rows.shape[0])
    return out


def prompt_logprob_rows(states, num_computed: np.ndarray, num_scheduled: np.ndarray,
                        query_start_loc: np.ndarray) -> dict[str, tuple[range, np.ndarray]] | None:
    """For each request of a step that wants prompt logprobs: the prompt positions this step
    predicts and the hidden-state rows that predict them (None when no request wants any).
    `states` are the runner's request states, in the step's order."""
    rows = {}
    for i, state in enumerate(states):
        # A request with output tokens sent its prompt logprobs already (a recompute after
        # preemption runs the prompt again; its scores are not needed twice).
        if state.sampling_params.prompt_logprobs is None or state.output_token_ids:
            continue
        where = predicting_positions(int(num_computed[i]), int(num_scheduled[i]),
                                     len(state.prompt_token_ids))
        if where:
            rows[state.req_id] = (where, hidden_rows(int(query_start_loc[i]),
                                                     int(num_computed[i]), where))
    return rows or None


def hidden_rows(query_start: int, num_computed: int, positions: range) -> np.ndarray:
    """Rows of the step's hidden states holding `positions` of a request whose scheduled tokens
    start at row `query_start` and at position `num_computed`."""
    return np.arange(positions.start, positions.stop) - num_computed + query_start
