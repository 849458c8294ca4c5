"""Choosing each IR op's implementation: a priority list of providers per op (the user's
`ir_op_priority` over the platform's defaults), resolved once at start-up, the same choice in
eager forwards and in compiled graphs (the lowering pass reads the same `Selection`).
"""
from dataclasses import dataclass

import torch

from kiln import envs
from kiln.errors import ConfigError
from kiln.ir.op import PROVIDERS, REGISTRY


def platform_defaults(device: str) -> dict[str, list[str]]:
    """Each op's priority list on a device: Kiln's CPU kernels first on CPU
    (`KILN_NATIVE_CPU_OPS=0`: the torch reference first); on CUDA the `cuda` provider's
    (today fp8's `torch._scaled_mm` only), else the torch reference."""
    if torch.device(device).type == "cpu":
        first = ["native", "torch"] if envs.native_cpu_ops() else ["torch", "native"]
    else:
        first = ["cuda", "torch"]
    return {name: list(first) for name in REGISTRY}


def custom_ops_priority(custom_ops: list[str], device: str) -> dict[str, list[str]]:
    """vLLM's compilation_config.custom_ops as IR op priorities: "all" / "none" put every op's
    kernel / torch reference first, then "+op" / "-op" one op's."""
    kernel = "native" if torch.device(device).type == "cpu" else "cuda"
    on, off = [kernel, "torch"], ["torch"]
    out: dict[str, list[str]] = {}
    for entry in custom_ops:
        if entry in ("all", "none"):
            out = {name: list(on if entry == "all" else off) for name in REGISTRY}
        elif not (isinstance(entry, str) and entry[:1] in ("+", "-") and entry[1:] in REGISTRY):
            raise ConfigError(f"compilation_config.custom_ops: {entry!r} is none of 'all', "
                              f"'none', '+OP', '-OP' for an IR op ({', '.join(sorted(REGISTRY))})")
    # Both ways for one op, or "all" and "none": which was meant is unknowable (vLLM asserts).
    if {"all", "none"} <= set(custom_ops):
        raise ConfigError("compilation_config.custom_ops holds both 'all' and 'none'; keep one")
    both = sorted({e[1:] for e in custom_ops if e[0] == "+"} & {e[1:] for e in custom_ops
                                                                 if e[0] == "-"})
    if both:
        raise ConfigError(f"compilation_config.custom_ops turns {', '.join(both)} both on (+) "
                          "and off (-); keep one")
    for entry in custom_ops:
        if entry[0] in "+-":
            out[entry[1:]] = list(on if entry[0] == "+" else off)
    return out


def check_priority(priority: dict) -> dict[str, list[str]]:
    """`priority` ({op: [provider, ...]}) checked against the registry; an unknown op or provider
    is a ValueError listing the valid ones."""
    if not isinstance(priority, dict):
        # ValueError, as for every bad engine argument (callers report those by field)
        raise ConfigError(  # noqa: TRY004
            f"ir_op_priority must be a dict of op name -> list of providers, got {priority!r}")
    checked = {}
    for op, providers in priority.items():
        if op not in REGISTRY:
            raise ConfigError(f"ir_op_priority: unknown IR op {op!r}; valid ops: "
                              f"{', '.join(sorted(REGISTRY))}")
        if isinstance(providers, str):
            providers = [providers]
        if not (isinstance(providers, (list, tuple)) and providers
                and all(isinstance(p, str) for p in providers)):
            raise ConfigError(f"ir_op_priority[{op!r}] must be a non-empty list of provider "
                              f"names, got {providers!r}")
        for p in providers:
            if p not in PROVIDERS:
                raise ConfigError(f"ir_op_priority[{op!r}]: unknown provider {p!r}; valid "
                                  f"providers: {', '.join(PROVIDERS)}")
        checked[op] = list(providers)
    return checked


def parse_cli(values: list[str] | None) -> dict[str, list[str]]:
    """`--ir-op-priority rms_norm=native,torch` (repeatable; a later one for the same op wins)."""
    parsed = {}
    for value in values or []:
        op, sep, providers = value.partition("=")
        if not sep or not op.strip() or not providers.strip():
            raise ConfigError(f"--ir-op-priority takes OP=PROVIDER[,PROVIDER...], e.g. "
                              f"rms_norm=native,torch; got {value!r}")
        parsed[op.strip()] = [p.strip() for p in providers.split(",") if p.strip()]
    return check_priority(parsed)


@dataclass(frozen=True)
class Selection:
    """The chosen provider of every IR op."""
    chosen: tuple[tuple[str, str], ...]  # (op, provider), sorted by op

    def as_dict(self) -> dict[str, str]:
        return dict(self.chosen)

    def provider(self, op: str) -> str:
        return self.as_dict()[op]


def resolve(priority: dict | None, device: str, dtype: torch.dtype) -> Selection:
    """Each op's first provider that implements it and supports the op's arguments as a model
    of `dtype` on `device` passes them; the torch reference when none of the list does."""
    lists = {**platform_defaults(device), **check_priority(priority or {})}
    chosen = []
    for name, op in sorted(REGISTRY.items()):
        args = op.example_args(dtype, device)
        provider = next((p for p in lists[name] if op.supported_by(p, *args)), "torch")
        chosen.append((name, provider))
    return Selection(tuple(chosen))


_applied: Selection | None = None


def apply(selection: Selection) -> None:
    """Bind every op to its chosen implementation, process-wide (an engine applies its own as
    it builds its model and before each forward: a cheap identity check when unchanged)."""
    global _applied
    if selection is _applied:
        return
    for name, provider in selection.chosen:
        REGISTRY[name].bind(provider)
    _applied = selection


def applied() -> dict[str, str]:
    """What every op is bound to now (the eager side of the record)."""
    return {name: op.provider for name, op in sorted(REGISTRY.items())}
