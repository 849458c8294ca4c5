"""`IrOp`: one Kiln IR op: a torch.library schema, a fake, a plain-torch reference that defines its
meaning, and the implementations providers register for it, one of which is bound at start-up.

Calling an IrOp outside tracing runs the bound implementation directly (no dispatcher, no
predicate); under Dynamo it emits the op itself, one node that Kiln's passes see and lower.
"""
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kiln.custom_ops import register_op

# Provider names an ir_op_priority list may hold; an op has an implementation for some of them.
PROVIDERS = ("native", "cuda", "torch")


def _always(*args) -> bool:
    return True


class LazyOp:
    """`torch.ops.kiln.<name>.default` of an op a library defines (kiln/native), named before
    the library is loaded: `resolved()` is the op itself once it exists (what bound
    implementations and lowered graphs call: no Python between the caller and the dispatcher)."""
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def resolved(self):
        packet = getattr(torch.ops.kiln, self.name, None)
        return packet.default if packet is not None else self

    def __call__(self, *args):
        return getattr(torch.ops.kiln, self.name).default(*args)

    def __repr__(self) -> str:
        return f"LazyOp(kiln::{self.name})"


def resolved(fn):
    """fn, or the op a LazyOp names once it exists."""
    return fn.resolved() if isinstance(fn, LazyOp) else fn


@dataclass(frozen=True)
class InplaceVariant:
    """The in-place form of an implementation's graph op, for compiled graphs that own the
    inputs it overwrites (kiln/compilation/passes/reinplace_ir_ops.py decides that): `op` takes
    the functional op's arguments, returns nothing and writes the functional op's output i into
    argument `mutates[i]`; `supported(*args)` says whether those arguments are laid out as it
    writes them (a copy cannot stand in for an argument written in place)."""
    op: Any
    mutates: tuple[int, ...]
    supported: Callable[..., bool] = _always


@dataclass(frozen=True)
class Implementation:
    """One provider's implementation of an op. `fn` runs it in eager forwards; `graph_op`, the
    torch op the lowering pass puts in a compiled graph for it (None: `fn` is plain torch code,
    inlined there so that Inductor fuses it with its neighbours). `supported(*args)` answers for
    the op's arguments (dtype, device, shapes, CPU ISA, the kernel built). `fn` and `graph_op`
    may be a LazyOp (a native library's op, resolved when bound or lowered). `inplace`: the
    in-place form of `graph_op`, if it has one (eager forwards never call it)."""
    provider: str
    fn: Callable
    supported: Callable[..., bool] = _always
    graph_op: Any = None
    inplace: InplaceVariant | None = None


class IrOp:
    """See the module docstring. `example_args(dtype, device)` gives arguments of the op as a
    model of that dtype on that device passes them: what selection asks `supported` about."""

    def __init__(self, name: str, schema: str, reference: Callable, fake: Callable,
                 example_args: Callable[[torch.dtype, str], tuple],
                 kernel: Callable | None = None):
        self.name, self.schema = name, schema
        self.reference, self.example_args = reference, example_args
        # The op's own kernel (what a graph that kept the IR node calls: modes 1 and 2, or
        # before lowering) runs the bound implementation too, unless the op brings its own.
        register_op(name, schema, kernel or self._run_bound, fake)
        self.packet = getattr(torch.ops.kiln, name).default
        self.impls: dict[str, Implementation] = {"torch": Implementation("torch", reference)}
        # Until an engine applies its selection: the platform default, chosen at the first call
        # (or `chosen()`) and kept.
        self.provider: str | None = None
        self.bound: Callable = self._bind_default

    def register(self, impl: Implementation) -> None:
        if impl.provider not in PROVIDERS:
            raise ValueError(f"provider {impl.provider!r} is not one of {', '.join(PROVIDERS)}")
        self.impls[impl.provider] = impl

    def bind(self, provider: str) -> None:
        self.provider, self.bound = provider, resolved(self.impls[provider].fn)

    def _bind_default(self, *args):
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), "cpu")
        self.bind(self._default(str(device), args))
        return self.bound(*args)

    def _default(self, device: str, args: tuple) -> str:
        from kiln.ir.selection import platform_defaults

        return next((p for p in platform_defaults(device)[self.name]
                     if self.supported_by(p, *args)), "torch")

    def chosen(self, device: str, dtype: torch.dtype) -> str:
        """The bound provider; the platform default for a model of dtype on device (bound from
        now on) when no selection was applied."""
        if self.provider is None:
            self.bind(self._default(device, self.example_args(dtype, device)))
        return self.provider

    def supported_by(self, provider: str, *args) -> bool:
        impl = self.impls.get(provider)
        return impl is not None and bool(impl.supported(*args))

    def _run_bound(self, *args):
        return self.bound(*args)

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            return self.packet(*args)
        return self.bound(*args)

    def __repr__(self) -> str:
        return f"IrOp(kiln::{self.name}, bound to {self.provider})"


REGISTRY: dict[str, IrOp] = {}


def define(name: str, schema: str, reference: Callable, fake: Callable,
           example_args: Callable[[torch.dtype, str], tuple],
           kernel: Callable | None = None) -> IrOp:
    if name in REGISTRY:
        raise ValueError(f"IR op {name!r} is defined twice")
    op = REGISTRY[name] = IrOp(name, schema, reference, fake, example_args, kernel)
    return op
