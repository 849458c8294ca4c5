"""Kiln's op schemas as a part of Inductor's cache key: `schemas_hash()`, which Kiln's pass
manager hashes in, and `stock_options(backend)`, a no-op post-grad pass keying stock Inductor.

Inductor's FX-graph cache key holds the graph's code, whose calls leave out arguments at their
defaults, but not the ops' schemas: a schema that gained or lost an argument loaded code calling
the op with its old ones (seen: mode 2 after kiln::linear lost its `blocks` argument).
"""
import functools
import hashlib

from torch._inductor.custom_graph_pass import CustomGraphPass


@functools.cache
def schemas_hash() -> str:
    """A hash of every `kiln::` op's schema: those defined in Python (kiln/custom_ops.py, all
    defined on import), and the C++ sources that define the rest (read, not loaded: the same
    answer before and after the library loads)."""
    from kiln.custom_ops import SCHEMAS
    from kiln.native import build

    h = hashlib.sha256("\n".join(sorted(SCHEMAS)).encode())
    h.update(build.sources_digest().encode())
    return h.hexdigest()[:16]


class KilnOpSchemas(CustomGraphPass):
    """Rewrites nothing; its uuid is `schemas_hash()`."""

    def __call__(self, graph) -> None:
        return None

    def uuid(self) -> str:
        return schemas_hash()


def stock_options(backend, inductor_config: dict | None = None) -> dict | None:
    """torch.compile options for a stock backend (modes 1 and 2): the user's
    compilation_config.inductor_compile_config (vLLM passes it to torch.compile there too; it
    was dropped) and Inductor's cache keyed on Kiln's op schemas; None for any other backend."""
    if backend != "inductor":
        return None
    return {**(inductor_config or {}), "post_grad_custom_post_pass": KilnOpSchemas()}
