"""The part of a decode step no compilation config can remove: the model's linear layers and LM
head run alone, with the kernels the model calls, on a batch of rows (`kiln bench latency`).

On a CPU a small-batch step is mostly these matmuls (a batch-1 step reads every weight once), so
a config's speedup over another is bounded by first / floor; the report gives each config's time
above the floor, which is what compilation can act on.
"""
import time

import torch
from torch import nn

from kiln.model.layers.linear import LinearBase


class LinearFloor:
    """Runs every linear layer of `model` once, then its LM head, on [batch, in] rows."""

    def __init__(self, model: nn.Module):
        self.linears = [m for m in model.modules() if isinstance(m, LinearBase)]
        self.model = model
        if not self.linears or not hasattr(model, "lm_head"):
            raise ValueError(f"{type(model).__name__} has no Kiln linear layers or LM head to "
                             "measure a floor with")
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}
        # Activations are in the model dtype, which the LM head keeps (a quantized linear's
        # weight is int8 or fp8)
        self.dtype = model.lm_head.weight.dtype
        # where the weights live (a GGUF layer may have let its dense weight go: a meta tensor)
        self.device = next(t.device for t in model.parameters() if not t.is_meta)

    def _rows(self, batch: int, width: int) -> torch.Tensor:
        key = (batch, width)
        if key not in self._inputs:
            self._inputs[key] = torch.randn(batch, width, dtype=self.dtype, device=self.device)
        return self._inputs[key]

    @torch.no_grad()
    def run(self, batch: int) -> None:
        for m in self.linears:
            m(self._rows(batch, m.weight.shape[1]))  # [batch, out]
        head = self.model.lm_head.weight  # [vocab, hidden]
        self.model.compute_logits(self._rows(batch, head.shape[1]))  # [batch, vocab]

    def time(self, batch: int, passes: int) -> list[float]:
        """Seconds per pass (CPU: the ops have finished when they return)."""
        times = []
        for _ in range(passes):
            start = time.perf_counter()
            self.run(batch)
            times.append(time.perf_counter() - start)
        return times


def above_floor(results: dict, floor: dict) -> dict:
    """Median ms above the floor's median, per batch size."""
    return {b: results[b]["median_ms"] - floor[b]["median_ms"] for b in results}


def speedup_ceiling(first: dict, floor: dict) -> dict:
    """The most any config could gain over `first`: first's median over the floor's."""
    return {b: first[b]["median_ms"] / floor[b]["median_ms"] for b in first}
