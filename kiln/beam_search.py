"""Beam search's parameters, sequences and scoring (vLLM's `vllm.beam_search` and
`vllm.sampling_params.BeamSearchParams`): pure data and functions, no engine.

A sequence's score is vLLM's (after HF's): its cumulative logprob over its length to the power
`length_penalty`, the length counting the prompt's tokens and not a final end-of-sequence
token. The search itself is kiln.entrypoints.beam_search.
"""
import math
from dataclasses import dataclass, field

from kiln.outputs import Logprob

# The sampler divides logits by the temperature in float32 (as SamplingParams bounds it).
_MAX_TEMPERATURE = 3.4028234663852886e38


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams: `beam_width` sequences kept per prompt, each step extending
    every live one by one token, for at most `max_tokens` steps."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        def integer(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def number(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        def check(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        check(integer(self.beam_width) and self.beam_width >= 1, "beam_width",
              "an integer >= 1")
        check(integer(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
              "an integer >= 1")
        check(isinstance(self.ignore_eos, bool), "ignore_eos", "a bool")
        check(isinstance(self.include_stop_str_in_output, bool), "include_stop_str_in_output",
              "a bool")
        check(number(self.temperature) and 0 <= self.temperature <= _MAX_TEMPERATURE,
              "temperature", f"in [0, {_MAX_TEMPERATURE:.4g}]")
        check(number(self.length_penalty), "length_penalty", "a finite number")


@dataclass
class BeamSearchSequence:
    """One beam: its tokens (the prompt's first), the logprobs each step offered (the chosen
    token's among them) and the sum of its chosen tokens' logprobs. `text` is filled when the
    sequence is returned."""
    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def lora_request(self) -> None:
        """vLLM's field: Kiln serves no LoRA adapters."""
        return None


@dataclass
class BeamSearchOutput:
    """One prompt's result: at most beam_width sequences, best first."""
    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id: int | None,
                          length_penalty: float = 1.0) -> float:
    """vLLM's score: cumulative_logprob / len ** length_penalty, where len counts the prompt and
    not a final eos token (HF's beam scorer's normalization, as vLLM adapted it)."""
    seq_len = len(tokens)
    if tokens and tokens[-1] == eos_token_id:
        seq_len -= 1
    # A bare eos (an empty prompt's first token) has length 0: count it as 1, not a
    # ZeroDivisionError (or 0 ** negative).
    seq_len = max(seq_len, 1)
    try:
        return cumulative_logprob / (seq_len ** length_penalty)
    except (OverflowError, ZeroDivisionError):
        # A large |length_penalty| (length_penalty=1000 past 10 tokens) overflows the power
        # (or underflows it to 0): rank in log space, where the order the division would give
        # still holds, instead of failing the search (a 500 on the server).
        if cumulative_logprob == 0:
            return 0.0
        log_score = math.log(abs(cumulative_logprob)) - length_penalty * math.log(seq_len)
        return math.copysign(math.exp(min(log_score, 709.0)), cumulative_logprob)


def create_sort_beams_key_function(eos_token_id: int | None, length_penalty: float):
    def sort_beams_key(x: BeamSearchSequence) -> float:
        return get_beam_search_score(x.tokens, x.cum_logprob, eos_token_id, length_penalty)

    return sort_beams_key
