"""`kiln::lora_add`'s by-slot provider (native, CPU) against the torch reference: the same
result for any mix of slots (unused slots, no adapter, one adapter for all), in the model's
dtype and with adapters held in another (--lora-dtype); CPU engines choose it by default; the
slots a step uses, published once by the model runner, are read (not recomputed per call)."""
import gc

import pytest
import torch

from kiln import ir
from kiln.ir import lora as ir_lora
from kiln.ir.lora import _lora_add_by_slot, _lora_add_ref, publish_step_slots


def _inputs(indices, adapter_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = len(indices)
    x, base = torch.randn(t, 48, generator=g), torch.randn(t, 40, generator=g)
    a = torch.randn(4, 12, 48, generator=g).to(adapter_dtype)  # 4 slots, rank 12
    b = torch.randn(4, 12, 40, generator=g).to(adapter_dtype)
    return x, base, a, b, torch.tensor(indices, dtype=torch.int64)


@pytest.mark.parametrize("indices", [
    [0, 0, 2, -1, 2, 0, -1, 3],  # three slots of four, and tokens with no adapter
    [1] * 7,  # one adapter for every token
    [-1] * 5,  # the base model only
    [3, -1, -1, 1],
])
@pytest.mark.parametrize("adapter_dtype", [torch.float32, torch.bfloat16])
def test_by_slot_equals_the_reference(indices, adapter_dtype):
    args = _inputs(indices, adapter_dtype)
    got, want = _lora_add_by_slot(*args), _lora_add_ref(*args)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plain = args[-1] < 0
    assert torch.equal(got[plain], args[1][plain])  # no adapter: the base output, bit for bit
    assert got.data_ptr() != args[1].data_ptr()  # a new tensor (the op is functional)


def test_cpu_engines_bind_the_by_slot_provider():
    assert ir.lora_add.supported_by("native", *_inputs([0, -1]))
    assert ir.lora_add.impls["native"].graph_op is torch.ops.kiln.lora_add_by_slot.default
    x, base, a, b, indices = _inputs([2, 0, -1])
    torch.testing.assert_close(torch.ops.kiln.lora_add_by_slot(x, base, a, b, indices),
                               _lora_add_ref(x, base, a, b, indices))


def count_unique(monkeypatch) -> list:
    """torch.unique's calls from here on (the provider's host read of the slots)."""
    calls, real = [], torch.unique
    monkeypatch.setattr(torch, "unique", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("tokens, slots, uniform", [
    ([2, 2, 0, -1, 0, 2], [0, 2], 0), ([1] * 6, [1], 6), ([3] * 4, [3], 4), ([-1] * 3, [], 0)])
def test_the_published_step_slots_are_read_not_recomputed(monkeypatch, tokens, slots, uniform):
    """The runner's buffer, padded with -1 past the step's tokens: sliced to the tokens or
    to the padded length, the provider gives the reference's result without torch.unique."""
    x, base, a, b, _ = _inputs([0] * 8)
    buffer = torch.full((16,), -1, dtype=torch.int64)
    buffer[:len(tokens)] = torch.tensor(tokens)
    publish_step_slots(buffer, slots, uniform)
    calls = count_unique(monkeypatch)
    for t in (len(tokens), 8):
        args = (x[:t], base[:t], a, b, buffer[:t])
        torch.testing.assert_close(_lora_add_by_slot(*args), _lora_add_ref(*args), rtol=1e-5,
                                   atol=1e-5)
    assert calls == []
    _lora_add_by_slot(x, base, a, b, buffer[1:9].clone())  # another tensor: read from it
    assert calls == [1]
    key = buffer.data_ptr()
    del buffer, args
    gc.collect()
    assert key not in ir_lora._STEP_SLOTS  # gone with its buffer
