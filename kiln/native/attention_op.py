"""Python side of the C++ CPU kernel of `kiln::unified_attention` (csrc/attention_op.cpp): handing
it each step's metadata and an engine's table of layers (a torch custom-class object).

The C++ kernel serves a step's layers only once a step was handed over (`begin_step`), and only
those in the table; every other call goes to the Python implementation, as before.
"""
import torch

from kiln.native import build, paged_attention

KINDS = ("kernel", "python")  # the C++ kernel's calls: served there, sent to Python


def available() -> bool:
    """The kernels built and loaded; False (with one warning) when they cannot be built."""
    return build.available()


class LayerTable:
    """An engine's layers as the C++ kernel finds them by name: each one's KV cache [2, nb, bs,
    nkv, hd] (held weakly there: a replaced cache is freed at once), scale, sliding window (None:
    none) and attention logit soft cap (None: none)."""

    def __init__(self, layers: dict[str, tuple[torch.Tensor, float, int | None, float | None]]):
        entries = list(layers.values())
        self.layers = torch.classes.kiln.AttentionLayers(
            list(layers), [e[0] for e in entries], [float(e[1]) for e in entries],
            [int(e[2] or 0) for e in entries], [float(e[3] or 0.0) for e in entries])


def begin_step(table: LayerTable, step: paged_attention.StepArgs, num_actual_tokens: int) -> None:
    """Until `end_step`, calls for the table's layers attend with `step` (whose tensors the C++
    side holds until then); rows from num_actual_tokens on are padding, zeroed."""
    torch.ops.kiln.attention_begin_step(table.layers, *step.tensors(), step.block_size,
                                        num_actual_tokens)


def end_step() -> None:
    torch.ops.kiln.attention_end_step()


def call_counts() -> dict[str, int]:
    """The C++ kernel's calls so far (process-wide) by where they were served."""
    return dict(zip(KINDS, torch.ops.kiln.attention_call_counts()))
