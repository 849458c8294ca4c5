"""A process-wide count of KV cache assignments to attention layers: what keeps views of the
caches (the CPU backend's layer table for its C++ kernel) rebuilds them when it changed."""

_generation = 0


def bump() -> None:
    """A layer's KV cache tensor was assigned (a new cache, or none)."""
    global _generation
    _generation += 1


def current() -> int:
    return _generation
