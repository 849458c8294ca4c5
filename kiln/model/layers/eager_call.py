"""`EagerCall`: a layer's IR call (op and arguments) looked up once for eager forwards, dropped
whenever what it reads changes; traced forwards still read the layer's attributes.

Reading a parameter or buffer goes through nn.Module.__getattr__ (~0.4 us each, measured on 2
cores); a linear's call read six a step. Under Dynamo the attributes are read as before, so
parameters and buffers stay graph inputs (their sources are what the warm start maps back).
"""
import torch
from torch import nn


class EagerCall(nn.Module):
    """Mixin: `_call(x)` runs `self._build_call()`'s (IR op, args) as op(x, *args), building it
    at the first eager call. Setting or deleting an attribute named in `call_fields`, and
    `.to()` and every other `_apply` (which replace buffers without setattr), drop it. A write
    straight into `_parameters` / `_buffers` is not seen: torch.func.functional_call swaps
    tensors that way, so under it a built call keeps the layer's own (checking per call would
    cost ~0.7 us, measured on 2 shared cores); swap by setting the attribute instead."""
    call_fields: frozenset = frozenset()
    _eager_call = None  # (IR op, args) once built; the class default until then

    def _build_call(self) -> tuple:
        raise NotImplementedError

    def _call(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            op, args = self._build_call()  # the attributes: Dynamo lifts them as inputs
            return op(x, *args)
        call = self._eager_call
        if call is None:
            call = self.__dict__["_eager_call"] = self._build_call()
        # the op's bound implementation, as IrOp.__call__ runs it outside tracing (read per
        # call: an engine's selection may rebind it)
        return call[0].bound(x, *call[1])

    def _drop_call(self) -> None:
        self.__dict__.pop("_eager_call", None)

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if name in self.call_fields:
            self._drop_call()

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        if name in self.call_fields:
            self._drop_call()

    def _apply(self, fn, recurse=True):
        self._drop_call()
        return super()._apply(fn, recurse)
