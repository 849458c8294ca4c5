"""vLLM's repetition detection (SamplingParams.repetition_detection, the OpenAI requests'
max/min_repetition_pattern_size and repetition_min_count): a request whose output ends in a run
of one token pattern repeated min_count times ends (finish_reason "repetition")."""
from dataclasses import dataclass

# Patterns longer than this are refused: each step checks every size up to max_pattern_size
# (most at one comparison, a near repeat at up to size x min_count), on the core's step loop.
MAX_PATTERN_SIZE = 1024
# What the core reports as the stop_reason of a request it ended for repeating (vLLM's).
REPETITION_STOP_REASON = "repetition_detected"


@dataclass
class RepetitionDetectionParams:
    """max_pattern_size: the longest pattern (in tokens) looked for, 0: off; min_pattern_size:
    the shortest (0: 1); min_count: how many times in a row, at the output's end, it must
    appear (>= 2 where max_pattern_size is set)."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self):
        self.verify()

    def verify(self) -> None:
        check_fields(vars(self))

    @property
    def enabled(self) -> bool:
        return self.max_pattern_size > 0


def check_fields(fields: dict, names: dict[str, str] | None = None) -> None:
    """Refuse a bad setting of RepetitionDetectionParams' `fields`, naming the field as `names`
    calls it (default: repetition_detection.<field>; the OpenAI requests have their own)."""
    def name(field: str) -> str:
        return (names or {}).get(field, f"repetition_detection.{field}")

    for field in ("max_pattern_size", "min_pattern_size", "min_count"):
        v = fields[field]
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name(field)} must be an integer >= 0, got {v!r}")
    most, least, count = fields["max_pattern_size"], fields["min_pattern_size"], \
        fields["min_count"]
    size = name("max_pattern_size")
    if most > MAX_PATTERN_SIZE:
        raise ValueError(f"{size} must be at most {MAX_PATTERN_SIZE} tokens, got {most}")
    if least > most:
        raise ValueError(f"{name('min_pattern_size')} must be <= {size}, got {least} > {most}")
    if most and count < 2:
        raise ValueError(f"{name('min_count')} must be >= 2 where {size} is set (a pattern "
                         f"seen once is no repetition), got {count}; or set {size} to 0 (off)")
    if not most and (least or count):
        raise ValueError(f"{size} must be > 0 where {name('min_pattern_size')} or "
                         f"{name('min_count')} is given (0 turns repetition detection off)")


def ends_in_repetition(token_ids: list[int], params: RepetitionDetectionParams) -> bool:
    """Whether the last size x min_count tokens are one pattern of `size` tokens min_count
    times, for a size in [min_pattern_size (at least 1), max_pattern_size]."""
    n, count = len(token_ids), params.min_count
    for size in range(max(params.min_pattern_size, 1), params.max_pattern_size + 1):
        span = size * count
        if span > n:
            return False  # longer patterns need more tokens still
        # periodic with period `size` over the span; the last token's own match first, which
        # rules most sizes out at one comparison
        if token_ids[-1] == token_ids[-1 - size] and \
                token_ids[n - span:n - size] == token_ids[n - span + size:]:
            return True
    return False
