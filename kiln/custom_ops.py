"""Registering Kiln's custom ops (`kiln::...`) through torch.library's low-level API.

`torch.library.custom_op`'s Python wrapper costs more than twice a `Library.define` + `impl`
op's per call, and a decode step calls Kiln's ops about 150 times (docs/measurements.md).
"""
from collections.abc import Callable

import torch

LIB = torch.library.Library("kiln", "FRAGMENT")
SCHEMAS: list[str] = []  # every op defined here, "name(schema)", in order


def register_op(name: str, schema: str, impl: Callable, fake: Callable) -> None:
    """Define `kiln::<name><schema>` with one implementation for every device, plus its fake
    (shape-only) version for tracing. Mutated arguments are marked in the schema: `Tensor(a!)`."""
    LIB.define(f"{name}{schema}")
    SCHEMAS.append(f"{name}{schema}")
    LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"kiln::{name}", fake, lib=LIB)
