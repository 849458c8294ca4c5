"""`LoRAManager`: the model runner's adapters: host copies (up to --max-cpu-loras, LRU), the
max_loras device slots (loaded and evicted LRU) and the per-token slot index of each step."""
from collections import OrderedDict

import numpy as np
import torch

from kiln.errors import ConfigError
from kiln.ir.lora import publish_step_slots
from kiln.lora import layers as lora_layers
from kiln.lora.adapter import LoRAAdapter, load_adapter
from kiln.lora.load_failure import LoRALoadError, agree_on_failure


class LoRAManager:
    def __init__(self, model, lora_config, hf_config, max_num_tokens: int,
                 device: torch.device, dtype: torch.dtype):
        self.config, self.hf_config, self.dtype = lora_config, hf_config, dtype
        self.max_rank = lora_config.max_lora_rank
        self.indices = torch.full((max_num_tokens,), -1, dtype=torch.int64, device=device)
        publish_step_slots(self.indices, [], 0)  # no token has an adapter yet
        self.layers = lora_layers.attach(model, lora_config.max_loras, self.max_rank,
                                         self.indices, dtype)
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_int_id -> adapter
        self.slots: list[int | None] = [None] * lora_config.max_loras  # slot -> lora_int_id
        self._used: list[int] = [0] * lora_config.max_loras  # slot -> step last used
        self._step = 0

    def _host_adapter(self, lora) -> LoRAAdapter:
        adapter = self.host.pop(lora.lora_int_id, None)
        if adapter is None:
            try:
                adapter = load_adapter(lora.lora_path, self.hf_config, self.max_rank, self.dtype)
            except ConfigError as e:  # checked by the front end, changed on disk since
                raise LoRALoadError(lora.lora_int_id, str(e)) from None
        self.host[lora.lora_int_id] = adapter
        while len(self.host) > self.config.cpu_capacity:
            self.host.popitem(last=False)
        return adapter

    def _read_new(self, loras: list) -> None:
        """Host copies of the step's adapters that hold no slot, read before any slot changes;
        under tensor parallelism the ranks agree whether all read, so a rank that could not
        raises with the others (rather than leave them waiting in the forward's all-reduce)
        and every rank's slots stay the same (whether a step reads is decided by them)."""
        new = {lora.lora_int_id: lora for lora in loras
               if lora is not None and lora.lora_int_id not in self.slots}
        if not new:
            return
        failure = None
        for lora in new.values():
            try:
                self._host_adapter(lora)
            except LoRALoadError as e:
                failure = e if failure is None or e.lora_int_id > failure.lora_int_id else failure
        failure = agree_on_failure(failure, self.indices.device)
        if failure is not None:
            self.host.pop(failure.lora_int_id, None)
            raise failure

    def _slot_for(self, lora, needed: set[int]) -> int:
        if lora.lora_int_id in self.slots:
            return self.slots.index(lora.lora_int_id)
        free = [s for s, held in enumerate(self.slots) if held is None]
        if free:
            slot = free[0]
        else:  # the least recently used slot that this step does not need
            candidates = [s for s, held in enumerate(self.slots) if held not in needed]
            if not candidates:
                raise RuntimeError(f"a step needs more than max_loras ({len(self.slots)}) "
                                   "adapters; the scheduler must not schedule it")
            slot = min(candidates, key=self._used.__getitem__)
        lora_layers.write_slot(self.layers, slot, self._host_adapter(lora), self.max_rank)
        self.slots[slot] = lora.lora_int_id
        return slot

    def prepare_step(self, loras: list, num_scheduled: list[int]) -> None:
        """Slots for this step's adapters (one LoRARequest or None per scheduled request, in
        batch order) and the per-token slot index; padding tokens get -1."""
        self._step += 1
        self._read_new(loras)
        needed = {lora.lora_int_id for lora in loras if lora is not None}
        per_request = []
        for lora in loras:
            if lora is None:
                per_request.append(-1)
                continue
            slot = self._slot_for(lora, needed)
            self._used[slot] = self._step
            per_request.append(slot)
        tokens = np.repeat(np.asarray(per_request, dtype=np.int64),
                           np.asarray(num_scheduled, dtype=np.int64))
        host = np.full(self.indices.shape[0], -1, dtype=np.int64)
        host[:len(tokens)] = tokens
        self.indices.copy_(torch.from_numpy(host), non_blocking=False)
        # the slots in use, once for the step (the CPU provider of every LoRA layer reads them)
        slots = sorted({s for s, n in zip(per_request, num_scheduled) if s >= 0 and n > 0})
        uniform = len(tokens) if len(slots) == 1 and bool((tokens == slots[0]).all()) else 0
        publish_step_slots(self.indices, slots, uniform)


def attach_lora(model, kiln_config, max_num_tokens: int, device) -> LoRAManager | None:
    """The runner's LoRAManager, its buffers attached to `model`; None without --enable-lora."""
    config = getattr(kiln_config, "lora_config", None)
    if config is None:
        return None
    return LoRAManager(model, config, kiln_config.model_config.hf_config, max_num_tokens,
                       torch.device(device),
                       config.torch_dtype(kiln_config.model_config.torch_dtype))
