"""A process-wide count of changes to attention layers' KV caches (a cache tensor or its k/v scales
assigned): what keeps views of them (the CPU backend's layer table for its C++ kernel) rebuilds
them when it changed."""

_generation = 0


def bump() -> None:
    """A layer's KV cache tensor (a new cache, or none) or its k/v scales were assigned."""
    global _generation
    _generation += 1


def current() -> int:
    return _generation
