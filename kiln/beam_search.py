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
        from kiln.wire_ints import plain_number

        for name in ("beam_width", "max_tokens", "temperature", "length_penalty"):
            setattr(self, name, plain_number(getattr(self, name)))  # np.int64(4) as 4

        def integer(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def number(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        def check(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        check(integer(self.beam_width) and self.beam_width >= 1, "beam_width",
              "an integer >= 1")
        from kiln.sampling_params import check_num_sequences

        check_num_sequences("beam_width", self.beam_width)
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


def _scored_length(tokens: list[int], eos_token_id: int | None) -> int:
    seq_len = len(tokens)
    if tokens and tokens[-1] == eos_token_id:
        seq_len -= 1
    # A bare eos (an empty prompt's first token) has length 0: count it as 1, not a
    # ZeroDivisionError (or 0 ** negative).
    return max(seq_len, 1)


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id: int | None,
                          length_penalty: float = 1.0) -> float:
    """vLLM's score: cumulative_logprob / len ** length_penalty, where len counts the prompt and
    not a final eos token (HF's beam scorer's normalization, as vLLM adapted it)."""
    seq_len = _scored_length(tokens, eos_token_id)
    try:
        return cumulative_logprob / (seq_len ** length_penalty)
    except OverflowError:  # length_penalty=400 past 6 tokens: the power is past float range
        return math.copysign(0.0, cumulative_logprob)  # its limit (-inf / inf is no nan)
    except ZeroDivisionError:  # length_penalty=-400: the power underflowed to 0
        return -math.inf if cumulative_logprob < 0 else 0.0


def create_sort_beams_key_function(eos_token_id: int | None, length_penalty: float):
    """A sequence's sort key, larger better: (score, 0) or, where the score left float range (0
    or infinite: a large |length_penalty| made the power overflow or underflow), (score, the
    order the log of its magnitude gives) for what the division could not tell apart (such a
    search raised OverflowError before: a 500 on the server)."""
    def sort_beams_key(x: BeamSearchSequence) -> tuple[float, float]:
        score = get_beam_search_score(x.tokens, x.cum_logprob, eos_token_id, length_penalty)
        if score != 0 and math.isfinite(score):
            return score, 0.0
        if x.cum_logprob >= 0:  # a score of exactly 0 beats any below it
            return score, math.inf
        seq_len = _scored_length(x.tokens, eos_token_id)
        # the score is -exp(log_magnitude): the smaller the magnitude, the better
        return score, -(math.log(-x.cum_logprob) - length_penalty * math.log(seq_len))

    return sort_beams_key
