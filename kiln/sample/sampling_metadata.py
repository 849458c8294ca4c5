"""`SamplingMetadata`: the per-step sampling parameters of a batch, as tensors on the device.

Built once per step from the requests that sample; the sampler reads only this object.
"""
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from kiln.sample.logit_masks import BadWordIndex
from kiln.sampling_params import SamplingParams


class AllowedGroup(NamedTuple):
    rows: torch.Tensor  # [R] int64
    mask: torch.Tensor  # [V] bool: the tokens these rows may sample


class BiasGroup(NamedTuple):
    rows: torch.Tensor  # [R] int64
    cols: torch.Tensor  # [C] int64
    values: torch.Tensor  # [C] float32: added to each row's logits at cols


@dataclass
class SamplingMetadata:
    num_reqs: int
    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor | None  # [N] float32; greedy rows hold 1.0 (never divided by 0)
    greedy_mask: torch.Tensor | None  # [N] bool; None when all rows are greedy or all random
    top_k: torch.Tensor | None  # [N] int64, 0 = off; None when no row uses it
    top_p: torch.Tensor | None  # [N] float32, 1.0 = off
    min_p: torch.Tensor | None  # [N] float32, 0.0 = off
    # Seeded rows: row -> its request's own generator. Other random rows use default_generator.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    default_generator: torch.Generator | None = None
    # Penalties (None when no row uses any); token tensors are padded with vocab_size.
    repetition_penalty: torch.Tensor | None = None  # [N] float32
    presence_penalty: torch.Tensor | None = None  # [N] float32
    frequency_penalty: torch.Tensor | None = None  # [N] float32
    prompt_token_ids: torch.Tensor | None = None  # [N, max_prompt_len] int64
    output_token_ids: torch.Tensor | None = None  # [N, max_output_len] int64
    # (row indices, token ids) pairs to mask with -inf this step: stop tokens of rows under
    # min_tokens, and bad words' last tokens.
    min_tokens_rows: torch.Tensor | None = None  # [M] int64
    min_tokens_cols: torch.Tensor | None = None  # [M] int64
    # allowed_token_ids and logit_bias, one group per distinct setting: the samples of an n > 1
    # request share theirs, so n rows of a whole-vocabulary bias are one [V] array, not n.
    allowed: list[AllowedGroup] = field(default_factory=list)
    bias: list[BiasGroup] = field(default_factory=list)

    @property
    def edits_logits(self) -> bool:
        """Whether the sampler writes into the logits before sampling (then on a copy)."""
        return self.min_tokens_rows is not None or bool(self.allowed) or bool(self.bias)
    # logprobs: per row the number of top logprobs wanted (None: none); max over rows.
    num_logprobs: list[int | None] = field(default_factory=list)
    max_num_logprobs: int | None = None
    # Structured outputs: rows under a grammar and their token bitmasks (grammar_mask.py).
    grammar_rows: torch.Tensor | None = None  # [M] int64
    grammar_bitmask: torch.Tensor | None = None  # [M, ceil(V / 32)] int32, bit set = allowed

    @property
    def no_penalties(self) -> bool:
        return self.repetition_penalty is None


def _pad_tokens(seqs: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(s) for s in seqs), default=0)
    out = np.full((len(seqs), max(width, 1)), pad, dtype=np.int64)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = s
    return torch.from_numpy(out).to(device)


def build_sampling_metadata(
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None,
    vocab_size: int,
    device: torch.device,
) -> SamplingMetadata:
    """Gather one step's sampling parameters; rows follow `params` order.

    Token id lists are only read when a row uses penalties or min_tokens, so the common
    greedy batch costs one pass over the params and no token copies.
    """
    n = len(params)
    greedy = [p.greedy for p in params]
    all_greedy, all_random = all(greedy), not any(greedy)

    def floats(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    temperature = greedy_mask = top_k = top_p = min_p = None
    if not all_greedy:
        temperature = floats([1.0 if g else p.temperature for p, g in zip(params, greedy)])
        if not all_random:
            greedy_mask = torch.tensor(greedy, dtype=torch.bool, device=device)
        # Sampling filters only matter for rows that sample at random.
        if any(p.top_k > 0 and not g for p, g in zip(params, greedy)):
            top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
        if any(p.top_p < 1.0 and not g for p, g in zip(params, greedy)):
            top_p = floats([p.top_p for p in params])
        if any(p.min_p > 0.0 and not g for p, g in zip(params, greedy)):
            min_p = floats([p.min_p for p in params])

    meta = SamplingMetadata(
        num_reqs=n, all_greedy=all_greedy, all_random=all_random, temperature=temperature,
        greedy_mask=greedy_mask, top_k=top_k, top_p=top_p, min_p=min_p,
        default_generator=default_generator)
    meta.generators = {i: g for i, g in enumerate(generators)
                       if g is not None and not greedy[i]}

    if any(p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
           or p.frequency_penalty != 0.0 for p in params):
        meta.repetition_penalty = floats([p.repetition_penalty for p in params])
        meta.presence_penalty = floats([p.presence_penalty for p in params])
        meta.frequency_penalty = floats([p.frequency_penalty for p in params])
        meta.prompt_token_ids = _pad_tokens(prompt_token_ids, vocab_size, device)
        meta.output_token_ids = _pad_tokens(output_token_ids, vocab_size, device)

    rows, cols = [], []
    shared = {}  # this step's token-edit arrays by their fields (_request_arrays)
    for i, p in enumerate(params):
        if p.min_tokens and len(output_token_ids[i]) < p.min_tokens:
            stops = [t for t in p.min_tokens_held_ids if 0 <= t < vocab_size]
            rows.extend([i] * len(stops))
            cols.extend(stops)
        if p.bad_words_token_ids:
            banned = _request_arrays(p, vocab_size, shared)["bad_words"].bans(output_token_ids[i])
            rows.extend([i] * len(banned))
            cols.extend(banned)
    if rows:
        meta.min_tokens_rows = torch.tensor(rows, dtype=torch.int64, device=device)
        meta.min_tokens_cols = torch.tensor(cols, dtype=torch.int64, device=device)

    _token_edits(meta, params, vocab_size, device, shared)
    meta.num_logprobs = [p.logprobs for p in params]
    wanted = [k for k in meta.num_logprobs if k is not None]
    meta.max_num_logprobs = max(wanted) if wanted else None
    return meta


def _request_arrays(p: SamplingParams, vocab_size: int, shared: dict | None = None) -> dict:
    """What one request's token edits need at every step, built at its first and kept on its
    params: allowed_token_ids as a mask [V], logit_bias as columns and values, bad words by
    their ending. Rebuilding a whole-vocabulary list in Python at every step held every stream
    on the server for seconds. `shared`: this step's arrays by the fields they come from, so
    the samples of an n > 1 request (sharing those objects) build them once, not n times."""
    cached = p.__dict__.get("_kiln_step_arrays")
    if cached is not None and cached["vocab_size"] == vocab_size:
        return cached
    key = (id(p.allowed_token_ids), id(p.logit_bias), id(p.bad_words_token_ids), vocab_size)
    if shared is not None and key in shared:
        p.__dict__["_kiln_step_arrays"] = shared[key]
        return shared[key]
    mask = cols = values = None
    if p.allowed_token_ids:
        ids = np.asarray(p.allowed_token_ids, dtype=np.int64)
        mask = np.zeros(vocab_size, dtype=bool)
        mask[ids[ids < vocab_size]] = True
    if p.logit_bias:
        cols = np.fromiter(p.logit_bias.keys(), dtype=np.int64, count=len(p.logit_bias))
        values = np.fromiter(p.logit_bias.values(), dtype=np.float32, count=len(p.logit_bias))
        keep = cols < vocab_size
        cols, values = cols[keep], values[keep]
    cached = {"vocab_size": vocab_size, "allowed": mask, "bias_cols": cols,
              "bias_values": values,
              # a word holding an id past the logits (a tokenizer larger than the model's
              # vocabulary) is never written, and banning it would index past the row
              "bad_words": BadWordIndex([w for w in p.bad_words_token_ids or ()
                                         if all(0 <= t < vocab_size for t in w)])}
    p.__dict__["_kiln_step_arrays"] = cached
    if shared is not None:
        shared[key] = cached
    return cached


def _group_rows(params: Sequence[SamplingParams], name: str) -> list[list[int]]:
    """The rows that set field `name`, grouped by the identity of its value: an n > 1
    request's samples are shallow copies sharing their fields, so they form one group."""
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(params):
        if value := getattr(p, name):
            groups.setdefault(id(value), []).append(i)
    return list(groups.values())


def _token_edits(meta: SamplingMetadata, params: Sequence[SamplingParams], vocab_size: int,
                 device: torch.device, shared: dict) -> None:
    """allowed_token_ids and logit_bias of the rows that set them, one group per setting."""
    def rows_tensor(rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.int64, device=device)

    for rows in _group_rows(params, "allowed_token_ids"):
        mask = _request_arrays(params[rows[0]], vocab_size, shared)["allowed"]
        meta.allowed.append(AllowedGroup(rows_tensor(rows), torch.from_numpy(mask).to(device)))
    for rows in _group_rows(params, "logit_bias"):
        arrays = _request_arrays(params[rows[0]], vocab_size, shared)
        if len(arrays["bias_cols"]):
            meta.bias.append(BiasGroup(rows_tensor(rows),
                                       torch.from_numpy(arrays["bias_cols"]).to(device),
                                       torch.from_numpy(arrays["bias_values"]).to(device)))
