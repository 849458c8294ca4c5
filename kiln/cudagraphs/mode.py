"""CUDA graph modes (what to record) and the batch descriptor that keys one recorded graph.

Pure values: the dispatcher decides with them, the wrapper and the model runner carry them.
"""
import dataclasses
import enum

from kiln.errors import ConfigError


class CUDAGraphMode(enum.Enum):
    """What to record. The combined modes use one routine for decode and another for mixed."""
    NONE = 0
    PIECEWISE = 1  # each compiled piece is a graph; attention runs eagerly between them
    FULL = 2  # the whole forward is one graph (attention inside)
    FULL_DECODE_ONLY = 3  # FULL for all-decode batches, eager otherwise
    FULL_AND_PIECEWISE = 4  # FULL for all-decode batches, PIECEWISE otherwise

    @classmethod
    def parse(cls, value: "CUDAGraphMode | str | int") -> "CUDAGraphMode":
        """Accept a member, its name (any case) or its value (int or digit string)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            text = value.strip()
            if text.isdigit():
                value = int(text)
            elif text.upper() in cls.__members__:
                return cls[text.upper()]
        if isinstance(value, int) and not isinstance(value, bool):
            try:
                return cls(value)
            except ValueError:
                pass
        names = ", ".join(f"{m.name} ({m.value})" for m in cls)
        raise ConfigError(f"compilation_config.cudagraph_mode must be one of {names}; "
                          f"got {value!r}")

    def decode_mode(self) -> "CUDAGraphMode":
        """The runtime mode for batches where every request decodes one token."""
        return _HALVES[self][0]

    def mixed_mode(self) -> "CUDAGraphMode":
        """The runtime mode for prefill and mixed batches."""
        return _HALVES[self][1]

    def separate_routine(self) -> bool:
        return self.decode_mode() != self.mixed_mode()

    def has_full_cudagraphs(self) -> bool:
        return CUDAGraphMode.FULL in _HALVES[self]

    def has_piecewise_cudagraphs(self) -> bool:
        return CUDAGraphMode.PIECEWISE in _HALVES[self]

    def is_runtime_mode(self) -> bool:
        """Only NONE, PIECEWISE and FULL are what one step actually runs as."""
        return self in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL)


_M = CUDAGraphMode
_HALVES = {  # mode -> (decode half, mixed half)
    _M.NONE: (_M.NONE, _M.NONE),
    _M.PIECEWISE: (_M.PIECEWISE, _M.PIECEWISE),
    _M.FULL: (_M.FULL, _M.FULL),
    _M.FULL_DECODE_ONLY: (_M.FULL, _M.NONE),
    _M.FULL_AND_PIECEWISE: (_M.FULL, _M.PIECEWISE),
}


@dataclasses.dataclass(frozen=True)
class BatchDescriptor:
    """The key of one recorded graph: (padded) token count, request count, all-decode or not.

    PIECEWISE and mixed FULL keys carry only the token count (num_reqs None, uniform False);
    all-decode FULL keys carry num_reqs == num_tokens and uniform_decode True.
    """
    num_tokens: int
    num_reqs: int | None = None
    uniform_decode: bool = False

    def non_uniform(self) -> "BatchDescriptor":
        """The token-count-only key for the same padded size."""
        return BatchDescriptor(self.num_tokens)
