"""vLLM's repetition detection (SamplingParams.repetition_detection, the OpenAI requests' object
of that name or their flat fields): a request whose output ends in a run of one token pattern
repeated min_count times ends (finish_reason "repetition")."""
from collections import deque
from dataclasses import dataclass

from kiln.wire_ints import INT64_MAX, plain_number

# Patterns longer than this are refused: a token's check, on the core's step loop, visits each
# earlier copy of it among the last max_pattern_size tokens (RepetitionTracker).
MAX_PATTERN_SIZE = 1024
# A larger min_count could not cross to the engine core (msgpack's integers are 64-bit); no
# output is that long anyway.
MAX_MIN_COUNT = INT64_MAX
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
        for name, value in vars(self).items():  # numpy's integers as Python's (vLLM takes them)
            setattr(self, name, plain_number(value))
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
    if count > MAX_MIN_COUNT:
        raise ValueError(f"{name('min_count')} must be at most {MAX_MIN_COUNT}, got {count}")
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
    times, for a size in [min_pattern_size (at least 1), max_pattern_size] (vLLM's check),
    from scratch: RepetitionTracker keeps it for a growing list."""
    return RepetitionTracker(params).update(token_ids)


class RepetitionTracker:
    """ends_in_repetition for one request's growing output, each new token's work bounded by
    the earlier copies of that token among the last max_pattern_size (not by the output's
    length or size x min_count, which a request chooses: the core's step loop runs it)."""

    def __init__(self, params: RepetitionDetectionParams):
        self.least = max(params.min_pattern_size, 1)
        self.most, self.count = params.max_pattern_size, params.min_count
        self._start()

    def _start(self) -> None:
        self.seen = 0  # tokens of the output taken so far
        self.found = False  # whether they end in a repetition
        self._last_at: dict[int, deque] = {}  # token -> its latest positions, ascending
        # size -> (first, last) position of the latest run of tokens equal to the one `size`
        # before them; the output ends in a pattern of `size` repeated min_count times where
        # such a run ends at its last token and is size x (min_count - 1) long
        self._runs: dict[int, tuple[int, int]] = {}

    def update(self, token_ids: list[int]) -> bool:
        """Take the tokens appended since the last call; whether the output ends in a
        repetition now."""
        if len(token_ids) < self.seen:  # not the list that grew: start over
            self._start()
        for i in range(self.seen, len(token_ids)):
            self.found = self._take(token_ids[i], i)
        self.seen = len(token_ids)
        return self.found

    def _take(self, token: int, i: int) -> bool:
        earlier = self._last_at.setdefault(token, deque())
        while earlier and earlier[0] < i - self.most:
            earlier.popleft()
        found = False
        for p in earlier:  # the sizes at which this token repeats the one `size` before it
            size = i - p
            if size < self.least:
                break  # later positions are nearer still
            first, last = self._runs.get(size, (i, i - 2))
            first = first if last == i - 1 else i
            self._runs[size] = (first, i)
            found = found or i - first + 1 >= size * (self.count - 1)
        earlier.append(i)
        return found
