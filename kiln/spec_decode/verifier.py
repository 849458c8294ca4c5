"""The model runner's side of n-gram speculative decoding: a request's drafts are laid after
its tokens in the input batch (not counted as known tokens), run as more query tokens of one
step, and verified from the logits at every one of its 1 + k positions (rejection_sampler.py).
"""
import numpy as np
import torch

from kiln.core.outputs import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from kiln.sample.grammar_mask import bitmask_rows
from kiln.sample.logprobs import gather_logprobs, to_logprobs_lists
from kiln.sample.sampling_metadata import build_sampling_metadata
from kiln.spec_decode.rejection_sampler import draw_uniforms, rejection_sample


def write_drafts(runner, so: SchedulerOutput) -> None:
    """Each drafted request's drafts into its token row after its known tokens; the row's count
    stays, so accepted tokens are appended over them."""
    batch = runner.input_batch
    for req_id, drafts in so.scheduled_spec_decode_tokens.items():
        row = runner.requests[req_id].row
        n = int(batch.num_tokens[row])
        batch.token_ids[row, n:n + len(drafts)] = drafts


def num_drafts(so: SchedulerOutput, req_ids: list[str]) -> np.ndarray:
    spec = so.scheduled_spec_decode_tokens
    return np.fromiter((len(spec.get(r, ())) for r in req_ids), dtype=np.int64,
                       count=len(req_ids))


def spec_logits_indices(qsl: np.ndarray, samples: np.ndarray, drafts: np.ndarray) -> np.ndarray:
    """The rows whose logits are sampled: a sampling request's last 1 + k scheduled tokens."""
    ends = qsl[1:][samples].astype(np.int64)
    counts = drafts[samples] + 1
    starts = ends - counts
    return np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)]) if ends.size \
        else np.zeros(0, dtype=np.int64)


def sample_with_drafts(runner, so: SchedulerOutput, inputs, hidden: torch.Tensor
                       ) -> ModelRunnerOutput:
    """ModelRunner._sample for a step with drafts (inputs.logits_indices holds 1 + k rows for
    each sampling request)."""
    spec = so.scheduled_spec_decode_tokens
    states = [runner.requests[r] for r in inputs.sample_req_ids]
    drafts = [list(spec.get(s.req_id, ())) for s in states]
    logits = runner.model.compute_logits(hidden[inputs.logits_indices])  # [rows, V]
    # one row per position, each with the tokens before it (penalties, min_tokens, bad words)
    params, prompts, outputs, row_of = [], [], [], []
    for state, d in zip(states, drafts):
        row_of.append(len(params))
        for j in range(len(d) + 1):
            params.append(state.sampling_params)
            prompts.append(state.prompt_token_ids)
            outputs.append(state.output_token_ids + d[:j])
    meta = build_sampling_metadata(params, prompts, outputs, [None] * len(params),
                                   runner.default_generator, logits.shape[1], runner.device)
    grammar = bitmask_rows(inputs.sample_req_ids, so.structured_output_request_ids,
                           so.grammar_bitmask)
    if grammar is not None:  # requests under a grammar get no drafts: one row each
        rows = np.asarray(row_of, dtype=np.int64)[grammar[0]]
        meta.grammar_rows = torch.from_numpy(rows).to(runner.device)
        meta.grammar_bitmask = torch.from_numpy(grammar[1]).to(runner.device)
    greedy = [s.sampling_params.greedy for s in states]
    uniforms = draw_uniforms([len(d) + 1 for d in drafts], greedy,
                             [s.generator for s in states], runner.default_generator,
                             runner.device)
    emitted, row_tokens, raw_logprobs = rejection_sample(runner.sampler, logits, meta, drafts,
                                                         greedy, uniforms)
    logprobs: dict[str, list[LogprobsLists]] = {}
    if raw_logprobs is not None:
        lists = to_logprobs_lists(*gather_logprobs(raw_logprobs, row_tokens,
                                                   meta.max_num_logprobs), meta.num_logprobs)
        for state, start, tokens in zip(states, row_of, emitted):
            if state.sampling_params.logprobs is not None:
                logprobs[state.req_id] = lists[start:start + len(tokens)]
    sampled = {}
    for state, tokens in zip(states, emitted):
        for token in tokens:
            state.output_token_ids.append(token)
            runner.input_batch.append_token(state.row, token)
        sampled[state.req_id] = tokens
    return ModelRunnerOutput(
        req_ids=inputs.req_ids,
        sampled_token_ids=[sampled.get(r, []) for r in inputs.req_ids],
        logprobs=logprobs, prompt_logprobs=runner._prompt_logprobs(inputs, hidden))
