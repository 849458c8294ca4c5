"""`Sampler`: from last-token logits and `SamplingMetadata` to one sampled token per request.

Order (vLLM v1's): the grammar bitmask (structured outputs), raw logprobs, penalties, min_tokens
mask, greedy argmax / temperature, min-p, top-k, top-p, then one draw a row from the
probabilities (inverse_cdf.py's sample_rows: on CPU fused with the softmax), from the row's own
generator when the request is seeded.
"""
from dataclasses import dataclass

import torch

from kiln.sample.filters import apply_min_p, apply_top_k, apply_top_p
from kiln.sample.grammar_mask import apply_token_bitmask
from kiln.sample.inverse_cdf import sample_rows
from kiln.sample.logit_masks import apply_allowed_token_ids, apply_logit_bias
from kiln.sample.logprobs import gather_logprobs
from kiln.sample.nonfinite import log_softmax_of_sanitized, sanitize_logits
from kiln.sample.penalties import apply_all_penalties, mask_min_tokens
from kiln.sample.row_reductions import has_nan_or_posinf, row_argmax
from kiln.sample.sampling_metadata import SamplingMetadata


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    # Only when some row asked for logprobs: column 0 is the sampled token, then the top-K.
    logprob_token_ids: torch.Tensor | None = None  # [N, 1 + K] int64
    logprobs: torch.Tensor | None = None  # [N, 1 + K] float32
    sampled_ranks: torch.Tensor | None = None  # [N] int64
    # Only when some row's logits held NaN or +inf (nonfinite.py): those rows.
    nonfinite_rows: torch.Tensor | None = None  # [N] bool


def uniforms(rows: int, generators: dict[int, torch.Generator],
             default_generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """One uniform in [0, 1) a row (float64 [rows]); rows in `generators` draw from their own
    generator, so a seeded row's draw does not depend on the other rows of the batch."""
    u = torch.empty(rows, dtype=torch.float64, device=device)
    if len(generators) < rows:
        u.uniform_(generator=default_generator)
    for row, gen in generators.items():
        u[row:row + 1].uniform_(generator=gen)
    return u


class Sampler(torch.nn.Module):
    def process(self, logits: torch.Tensor, meta: SamplingMetadata
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The request's edits of the logits before temperature (grammar, allowed tokens,
        bias, penalties, min_tokens): (logits, raw logprobs or None, nonfinite rows or None).
        Speculative decoding's verifier (kiln/spec_decode) runs it per position too."""
        logits = logits.float()  # [N, V]
        nonfinite_rows = None
        if has_nan_or_posinf(logits):
            logits, nonfinite_rows = sanitize_logits(logits)
        if meta.grammar_rows is not None:
            # Before the logprobs, as vLLM: they are then those of the constrained distribution.
            logits = apply_token_bitmask(logits, meta.grammar_bitmask, meta.grammar_rows)
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = (logits.log_softmax(dim=1) if nonfinite_rows is None
                            else log_softmax_of_sanitized(logits))

        grammar_only = None  # the logits under the grammar alone, where the request edits them
        if meta.edits_logits:
            if meta.grammar_rows is not None:
                grammar_only = logits
            logits = logits.clone()  # the in-place edits must not write into the model's buffer
        for group in meta.allowed:
            logits = apply_allowed_token_ids(logits, group.rows, group.mask)
        for group in meta.bias:
            logits = apply_logit_bias(logits, group.rows, group.cols, group.values)
        if not meta.no_penalties:
            logits = apply_all_penalties(logits, meta.prompt_token_ids, meta.output_token_ids,
                                         meta.repetition_penalty, meta.presence_penalty,
                                         meta.frequency_penalty)
        if meta.min_tokens_rows is not None:
            logits = mask_min_tokens(logits, meta.min_tokens_rows, meta.min_tokens_cols)
        if grammar_only is not None:
            # The grammar wins over the request's own masks (min_tokens, allowed_token_ids,
            # bad words): a grammar row they leave no token in samples under the grammar alone
            # (a finished grammar allows only stop tokens), not token 0 outside it.
            rows = meta.grammar_rows
            dead = rows[torch.isneginf(logits[rows]).all(dim=1)]  # [<= G]
            logits[dead] = grammar_only[dead]

        return logits, raw_logprobs, nonfinite_rows

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits, raw_logprobs, nonfinite_rows = self.process(logits, meta)
        sampled = self.sample(logits, meta)
        out = SamplerOutput(sampled_token_ids=sampled, nonfinite_rows=nonfinite_rows)
        if raw_logprobs is not None:
            out.logprob_token_ids, out.logprobs, out.sampled_ranks = gather_logprobs(
                raw_logprobs, sampled, meta.max_num_logprobs)
        return out

    @staticmethod
    def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if meta.all_greedy:
            return row_argmax(logits)
        greedy = None if meta.all_random else row_argmax(logits)
        u = uniforms(logits.shape[0], meta.generators, meta.default_generator, logits.device)
        if Sampler.filters(meta):
            sampled = sample_rows(Sampler.filtered(logits, meta), None, u)
        else:  # the temperature goes into the draw's exponent: no divided copy of the logits
            sampled = sample_rows(logits, meta.temperature.reciprocal(), u)
        if greedy is not None:
            sampled = torch.where(meta.greedy_mask, greedy, sampled)
        return sampled

    @staticmethod
    def probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The random rows' distribution: temperature, then min-p, top-k, top-p ([N, V]; the
        greedy rows' are at temperature 1 and unused)."""
        return Sampler.filtered(logits, meta).softmax(dim=1, dtype=torch.float32)

    @staticmethod
    def filters(meta: SamplingMetadata) -> bool:
        return meta.min_p is not None or meta.top_k is not None or meta.top_p is not None

    @staticmethod
    def filtered(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The logits at temperature, min-p, top-k and top-p applied (what probs softmaxes)."""
        logits = logits / meta.temperature.unsqueeze(1)
        # min-p first, as vLLM's v1 sampler: top-p then measures its mass among the tokens
        # min-p kept (min-p itself gives the same set before or after top-k / top-p).
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        if meta.top_k is not None:
            logits = apply_top_k(logits, meta.top_k)
        if meta.top_p is not None:
            logits = apply_top_p(logits, meta.top_p)
        return logits
