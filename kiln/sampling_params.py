"""`SamplingParams`: how one request is decoded, validated up front with vLLM's field names.

Every invalid value raises ValueError naming the field and its allowed range.
"""
import enum
import math
from dataclasses import InitVar, dataclass, field, fields

from kiln.engine.text_encoding import check_texts
from kiln.envs import max_n_sequences, source
from kiln.repetition_detection import RepetitionDetectionParams  # vLLM's users import it here
from kiln.structured_output.params import (
    STRUCTURED_OUTPUT_KEYWORDS,
    TAKEN_STRUCTURED_OUTPUT_KEYWORDS,
    StructuredOutputsParams,
)
from kiln.wire_ints import INT64_MAX, INT64_MIN, check_wire_ints, plain_items, plain_number

_GREEDY_EPS = 1e-5
# The sampler divides logits by the penalty in float32: a smaller one overflows them.
_MIN_REPETITION_PENALTY = 1e-6
# Far past any useful penalty (vLLM has no bound), short of where a logit times it overflows
# float32 to -inf, which could leave a row nothing to sample.
_MAX_REPETITION_PENALTY = 1e6
# The sampler divides logits by the temperature in float32: a larger one is inf there, a
# masked token's -inf logit over it NaN, and the row sampled token 0 (outside
# allowed_token_ids too). float32's largest finite value.
_MAX_TEMPERATURE = 3.4028234663852886e38
_INT64 = (INT64_MIN, INT64_MAX)  # seeds: torch generators take 64 bits
# The fields that hold a number, and those that hold token ids (and biases): numpy's numbers in
# them are taken as the Python ones they equal (plain_number), as vLLM takes them.
_NUMBER_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "max_tokens", "min_tokens",
                  "logprobs", "prompt_logprobs", "truncate_prompt_tokens")
_TOKEN_ID_FIELDS = ("stop_token_ids", "allowed_token_ids", "logit_bias")
_PLAIN_TYPES = frozenset({int, float, type(None)})


def check_num_sequences(name: str, n: int) -> None:
    """Refuse more samples (n, beam_width) than KILN_MAX_N_SEQUENCES allows (vLLM's cap)."""
    most = max_n_sequences()
    if n > most:
        raise ValueError(f"{name} must be at most {most}, got {n}; to raise the limit, set "
                         f"{source('KILN_MAX_N_SEQUENCES')}")


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output carries all text so far
    DELTA = 1  # every output carries only what is new (streaming)
    FINAL_ONLY = 2  # one output when the request finishes (LLM.generate)


# Stop strings and stop token ids one request may give (OpenAI takes 4 strings; vLLM does not
# limit either): each is looked for, or copied per sample, for every request's sample.
MAX_STOP_STRINGS = 256
MAX_STOP_TOKEN_IDS = 1024
# Bad words x n one request may give (vLLM does not limit them): each sample's words are indexed
# on the engine core's step loop (the request crosses to the core once, its samples made there);
# 5,000 words at n=64 held every other stream on the server for 7 s.
MAX_BAD_WORDS_PER_REQUEST = 16384


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # Per prompt token after the first: its logprob and rank, and the top-N (N = this value).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # False (with skip_special_tokens=False): no spaces between two added tokens in a row, as
    # vLLM's detokenizer writes them (kiln/engine/added_token_spacing.py).
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # False: outputs carry token ids only (text "", logprob token strings None), as vLLM's.
    detokenize: bool = True
    # token id -> added to its logit before sampling, OpenAI's range [-100, 100].
    logit_bias: dict[int, float] | None = None
    # Only these tokens may be sampled.
    allowed_token_ids: list[int] | None = None
    # Words never generated: a word's last token is banned where its other tokens just came.
    bad_words: list[str] | None = None
    # Keep only the prompt's last N tokens (-1: as many as max_model_len leaves room for).
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Constrain the output to a schema, regex, choice or grammar (vLLM's name).
    structured_outputs: StructuredOutputsParams | None = None
    # End the request where its output repeats a pattern (vLLM's; a dict of its fields too).
    repetition_detection: RepetitionDetectionParams | None = None
    # Filled by the engine: every token id that ends the request (eos + stop_token_ids).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # Filled by the engine: the end-of-sequence token id where it ends the request (not
    # ignore_eos); never a stop_reason, even when stop_token_ids holds it too (as in vLLM).
    eos_stop_token_id: int | None = field(default=None, repr=False)
    # Filled by the engine: the tokens min_tokens holds back, the stop tokens and the model's
    # end tokens even under ignore_eos (vLLM's _all_stop_token_ids: a benchmark that sets both
    # wants min_tokens of text, not end tokens sampled as text).
    min_tokens_held_ids: set[int] = field(default_factory=set, repr=False)
    # Filled by the engine: the tokenizer's eos and the model's end tokens (generation_config).
    end_token_ids: set[int] = field(default_factory=set, repr=False)
    # Filled by the engine: bad_words as token id sequences (with and without a leading space).
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    # vLLM's arguments for custom logits processors and plugins (its server's vllm_xargs): Kiln
    # loads none, so none is taken; not a field (nothing crosses to the core).
    extra_args: InitVar[dict | None] = None
    # vLLM's other arguments, taken so its callers' code runs: custom logits processors (none
    # loadable here: refused when given), guided_decoding (its old name for structured_outputs:
    # refused naming it), skip_clone (a copy vLLM may skip; Kiln's engine copies anyway).
    logits_processors: InitVar[list | None] = None
    guided_decoding: InitVar[object | None] = None
    skip_clone: InitVar[bool] = False

    def __post_init__(self, extra_args: dict | None = None, logits_processors: list | None = None,
                      guided_decoding: object | None = None, skip_clone: bool = False):
        if extra_args:
            raise ValueError("extra_args is not supported: it carries arguments for custom "
                             "logits processors and plugins, and Kiln loads none; omit it")
        if logits_processors:
            raise ValueError("logits_processors is not supported: Kiln runs no per-request "
                             "Python logits processors; use logit_bias, allowed_token_ids, "
                             "bad_words or structured_outputs, or omit it")
        if guided_decoding is not None:
            raise ValueError("guided_decoding is vLLM's old name for structured_outputs: pass "
                             "structured_outputs=StructuredOutputsParams(...) instead")
        self.verify()

    def verify(self) -> None:
        """Normalize (stop as a list, top_k -1 as 0) and check every field, raising ValueError
        that names it. The engine calls it again on its copy: the dataclass is mutable."""
        for name in _NUMBER_FIELDS:
            v = getattr(self, name)
            if type(v) not in _PLAIN_TYPES:
                setattr(self, name, plain_number(v))
        for name in _TOKEN_ID_FIELDS:
            if v := getattr(self, name):
                setattr(self, name, plain_items(v))
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop, (list, tuple)) or self.stop is None:
            self.stop = list(self.stop or [])
        if isinstance(self.stop_token_ids, (list, tuple)) or self.stop_token_ids is None:
            self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:  # vLLM's "no seed"
            self.seed = None
        self._validate()
        self.all_stop_token_ids = set(self.stop_token_ids)
        self.min_tokens_held_ids = set(self.stop_token_ids)

    def _validate(self) -> None:
        def check(ok: bool, name: str, rule: str, value) -> None:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {value!r}")

        def integer(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def number(v) -> bool:  # finite, so that comparisons below are meaningful
            return (isinstance(v, (int, float)) and not isinstance(v, bool)
                    and math.isfinite(v))

        def in_range(name: str, lo: float, hi: float, rule: str) -> None:
            v = getattr(self, name)
            check(number(v) and lo <= v <= hi, name, rule, v)

        check(integer(self.n) and self.n >= 1, "n", "an integer >= 1", self.n)
        check_num_sequences("n", self.n)
        in_range("temperature", 0, _MAX_TEMPERATURE, f"in [0, {_MAX_TEMPERATURE:.4g}]")
        v = self.top_p
        check(number(v) and 0 < v <= 1, "top_p", "in (0, 1]", v)
        check(integer(self.top_k) and self.top_k >= 0, "top_k",
              "-1, 0 (off) or a positive integer", self.top_k)
        in_range("min_p", 0, 1, "in [0, 1]")
        in_range("presence_penalty", -2, 2, "in [-2, 2]")
        in_range("frequency_penalty", -2, 2, "in [-2, 2]")
        # Past 2 too, as vLLM and HF take it.
        in_range("repetition_penalty", _MIN_REPETITION_PENALTY, _MAX_REPETITION_PENALTY,
                 f"in [{_MIN_REPETITION_PENALTY}, {_MAX_REPETITION_PENALTY:g}]")
        check(self.max_tokens is None or (integer(self.max_tokens) and self.max_tokens >= 1),
              "max_tokens", "an integer >= 1 or None", self.max_tokens)
        check(integer(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
              "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None:
            check(self.min_tokens <= self.max_tokens, "min_tokens", "<= max_tokens",
                  self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):  # the engine's max_logprobs caps them
            v = getattr(self, name)
            check(v is None or (integer(v) and v >= -1), name,
                  "None, -1 (the whole vocabulary) or an integer >= 0", v)
        check(self.seed is None or (integer(self.seed) and _INT64[0] <= self.seed <= _INT64[1]),
              "seed", f"None or an integer in [{_INT64[0]}, {_INT64[1]}]", self.seed)
        check(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
              "stop", "a non-empty string or a list of them", self.stop)
        if len(self.stop) > MAX_STOP_STRINGS:
            # Each is looked for after every token of every sample: 20,000 of them held every
            # stream on the server for seconds.
            raise ValueError(f"stop must be at most {MAX_STOP_STRINGS} strings, got "
                             f"{len(self.stop)}")
        check_texts("stop", self.stop)
        check(isinstance(self.stop_token_ids, list)
              and all(integer(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "a list of non-negative integers", self.stop_token_ids)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            # 49,152 of them at n=128 held the server's other streams 7 s as the request came in
            raise ValueError(f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} ids, got "
                             f"{len(self.stop_token_ids)}")
        check(type(self.output_kind) is RequestOutputKind  # noqa: E721 - a bool is an int
              or (type(self.output_kind) is int and self.output_kind in set(RequestOutputKind)),
              "output_kind",
              f"one of {[k.name for k in RequestOutputKind]}", self.output_kind)
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output", "detokenize"):
            check(isinstance(getattr(self, name), bool), name, "True or False",
                  getattr(self, name))

        self._validate_token_fields(check, integer, number)
        so = self.structured_outputs
        if isinstance(so, dict):  # vLLM's dict form, and what a wire decode may hand over
            unknown = sorted(set(so) - STRUCTURED_OUTPUT_KEYWORDS)
            check(not unknown, "structured_outputs",
                  f"a dict of {sorted(TAKEN_STRUCTURED_OUTPUT_KEYWORDS)} (unknown: {unknown})", so)
            so = self.structured_outputs = StructuredOutputsParams(**so)
        check(so is None or isinstance(so, StructuredOutputsParams), "structured_outputs",
              "None or a StructuredOutputsParams", so)
        if so is not None:
            so.verify()

        rd = self.repetition_detection
        if isinstance(rd, dict):
            check(set(rd) <= {"max_pattern_size", "min_pattern_size", "min_count"},
                  "repetition_detection", "a dict of max_pattern_size, min_pattern_size and "
                  "min_count", rd)
            rd = self.repetition_detection = RepetitionDetectionParams(**rd)
        check(rd is None or isinstance(rd, RepetitionDetectionParams), "repetition_detection",
              "None or a RepetitionDetectionParams", rd)
        if rd is not None:
            rd.verify()
        check(self.detokenize is not False or not self.stop, "stop",
              "empty when detokenize=False (stop strings are found in the text; set "
              "detokenize=True or use stop_token_ids)", self.stop)
        # Every field crosses to the engine core as msgpack: an int past 64 bits anywhere
        # (max_tokens, n, a logit_bias key, a number in a JSON schema) is refused here, before
        # anything is queued, not met by the core client's encoder as an OverflowError.
        for f in fields(self):
            check_wire_ints(f.name, getattr(self, f.name))

    def _validate_token_fields(self, check, integer, number) -> None:
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, (str, tuple)):
            self.bad_words = [self.bad_words] if isinstance(self.bad_words, str) \
                else list(self.bad_words)
        v = self.logit_bias
        check(v is None or (isinstance(v, dict) and all(
            integer(k) and k >= 0 and number(b) and -100 <= b <= 100 for k, b in v.items())),
            "logit_bias", "None or a dict of token id (int >= 0) to a bias in [-100, 100]", v)
        v = self.allowed_token_ids
        check(v is None or (isinstance(v, list) and v and all(integer(t) and t >= 0 for t in v)),
              "allowed_token_ids", "None or a non-empty list of token ids (ints >= 0)", v)
        v = self.bad_words
        check(v is None or (isinstance(v, list) and all(isinstance(w, str) and w for w in v)),
              "bad_words", "None or a list of non-empty strings", v)
        if v and len(v) * self.n > MAX_BAD_WORDS_PER_REQUEST:
            raise ValueError(f"bad_words x n must be at most {MAX_BAD_WORDS_PER_REQUEST}, got "
                             f"{len(v)} x {self.n} = {len(v) * self.n}; give fewer bad words or "
                             "a smaller n")
        check_texts("bad_words", v or ())
        v = self.truncate_prompt_tokens
        check(v is None or (integer(v) and (v >= 1 or v == -1)), "truncate_prompt_tokens",
              "None, -1 (max_model_len) or an integer >= 1", v)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def update_from_tokenizer(self, eos_token_id: int | None, vocab_size: int,
                              model_end_ids=()) -> None:
        """Resolve the stop token set once the engine knows the tokenizer and vocabulary;
        `model_end_ids`: the model's other end tokens (generation_config), held back by
        min_tokens whether or not they stop the request."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise ValueError(f"stop_token_ids contains {t}, outside the vocabulary "
                                 f"[0, {vocab_size})")
        for name in ("allowed_token_ids", "logit_bias"):
            outside = sorted(t for t in (getattr(self, name) or ()) if t >= vocab_size)
            if outside:
                raise ValueError(f"{name} contains {outside[0]}, outside the vocabulary "
                                 f"[0, {vocab_size})")
        self.all_stop_token_ids = set(self.stop_token_ids)
        if self.top_k >= vocab_size:  # keeps every token: the same as off
            self.top_k = 0
        if eos_token_id is not None and not self.ignore_eos:
            self.all_stop_token_ids.add(eos_token_id)
            self.eos_stop_token_id = eos_token_id
        self.end_token_ids = {t for t in (eos_token_id, *model_end_ids)
                              if t is not None and 0 <= t < vocab_size}
        self.min_tokens_held_ids = self.all_stop_token_ids | self.end_token_ids

    def check_masks_leave_a_token(self) -> None:
        """Refuse masks that together leave nothing to sample, once the stop tokens and bad
        words are known: the sampler would draw token 0, which none of them allows."""
        if not self.allowed_token_ids:
            return
        allowed = set(self.allowed_token_ids)
        # A bad word bans its last token where the output ends with the rest of it: the tokens
        # banned after each such ending. The output holds allowed tokens only, so those are the
        # endings to check, each with the shorter endings it ends with (its suffixes).
        bans_after: dict[tuple, set[int]] = {}
        for word in self.bad_words_token_ids or ():
            bans_after.setdefault(tuple(word[:-1]), set()).add(word[-1])
        for ending in sorted(e for e in bans_after if set(e) <= allowed):
            banned = set().union(*(bans_after.get(ending[k:], ()) for k in range(len(ending) + 1)))
            if allowed <= banned:
                after = f" once the output ends with tokens {list(ending)}" if ending else ""
                raise ValueError(f"allowed_token_ids are all banned by bad_words{after}: no "
                                 "token is left to sample; allow another token or drop a bad "
                                 "word")
        left = allowed - bans_after.get((), set())
        if self.min_tokens and left <= self.min_tokens_held_ids:
            raise ValueError(f"allowed_token_ids hold only stop or end tokens, which min_tokens="
                             f"{self.min_tokens} holds back: no token is left to sample; allow "
                             "a token that is not a stop token, or drop min_tokens")

    def clone(self) -> "SamplingParams":
        import copy

        return copy.deepcopy(self)


# vLLM's users import it from here (vllm.sampling_params.BeamSearchParams).
from kiln.beam_search import BeamSearchParams  # noqa: E402,F401
