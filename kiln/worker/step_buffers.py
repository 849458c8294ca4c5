"""The model runner's persistent step inputs: host buffers filled through numpy views and, on a
GPU, a device twin of each (fixed addresses for CUDA graphs) refreshed from it every step. The
block table and slot mapping have a plane per KV cache group (kiln/core/kv_cache_groups.py)."""
import dataclasses

import numpy as np
import torch

from kiln.attention.metadata import AttentionMetadata


class StepBuffers:
    def __init__(self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int,
                 device: torch.device, num_groups: int = 1):
        on_host = device.type == "cpu"
        t, r, b = max_num_tokens, max_num_reqs, max_blocks_per_req

        def host(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, pin_memory=not on_host)

        self.input_ids_cpu = host(t, dtype=torch.int64)
        self.positions_cpu = host(t, dtype=torch.int64)
        # [groups, ...]; the unprefixed names are group 0's plane
        self.group_slot_mapping_cpu = host(num_groups, t, dtype=torch.int64)
        self.group_block_table_cpu = host(num_groups, r, b, dtype=torch.int32)
        self.slot_mapping_cpu = self.group_slot_mapping_cpu[0]
        self.query_start_loc_cpu = host(r + 1, dtype=torch.int32)
        self.seq_lens_cpu = host(r, dtype=torch.int32)
        self.block_table_cpu = self.group_block_table_cpu[0]
        # up to a row per token: speculative decoding samples every drafted position
        self.logits_indices_cpu = host(t, dtype=torch.int64)
        # numpy views for filling without per-element torch calls
        self.input_ids_np = self.input_ids_cpu.numpy()
        self.positions_np = self.positions_cpu.numpy()
        self.slot_mapping_np = self.slot_mapping_cpu.numpy()
        self.query_start_loc_np = self.query_start_loc_cpu.numpy()
        self.seq_lens_np = self.seq_lens_cpu.numpy()
        self.block_table_np = self.block_table_cpu.numpy()
        self.group_slot_mapping_np = self.group_slot_mapping_cpu.numpy()
        self.group_block_table_np = self.group_block_table_cpu.numpy()
        self.logits_indices_np = self.logits_indices_cpu.numpy()

        def dev(cpu: torch.Tensor) -> torch.Tensor:
            # On CPU the host buffer is the device buffer.
            return cpu if on_host else torch.zeros_like(cpu, device=device)

        self.input_ids = dev(self.input_ids_cpu)
        self.positions = dev(self.positions_cpu)
        self.group_slot_mapping = dev(self.group_slot_mapping_cpu)
        self.slot_mapping = self.group_slot_mapping[0]
        self.query_start_loc = dev(self.query_start_loc_cpu)
        self.seq_lens = dev(self.seq_lens_cpu)
        self.group_block_table = dev(self.group_block_table_cpu)
        self.block_table = self.group_block_table[0]
        self.logits_indices = dev(self.logits_indices_cpu)
        # name -> (device buffer, host twin), looked up once per staging on the step's path
        self._twins = {name: (getattr(self, name), getattr(self, f"{name}_cpu"))
                       for name in ("input_ids", "positions", "slot_mapping", "query_start_loc",
                                    "seq_lens", "block_table", "logits_indices")}
        for g in range(1, num_groups):  # groups 1..'s planes
            self._twins[f"slot_mapping{g}"] = (self.group_slot_mapping[g],
                                               self.group_slot_mapping_cpu[g])
            self._twins[f"block_table{g}"] = (self.group_block_table[g],
                                              self.group_block_table_cpu[g])
        self.num_groups = num_groups

    def staged(self, name: str, n: int) -> torch.Tensor:
        """The first n entries of buffer `name` on the device, refreshed from its host twin."""
        device_buf, host_buf = self._twins[name]
        if device_buf is not host_buf:
            device_buf[:n].copy_(host_buf[:n], non_blocking=True)
        return device_buf[:n]

    def attention_metadata(self, num_tokens: int, num_reqs: int, max_query_len: int,
                           max_seq_len: int, num_input_tokens: int,
                           uniform_decode: bool) -> AttentionMetadata:
        """Attention metadata over the first `num_reqs` rows and `num_input_tokens` slots the
        caller filled (group 0's, with every group's in its group_metadata)."""
        md = AttentionMetadata(
            num_actual_tokens=num_tokens, num_reqs=num_reqs, max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc=self.staged("query_start_loc", num_reqs + 1),
            seq_lens=self.staged("seq_lens", num_reqs),
            block_table=self.staged("block_table", num_reqs),
            slot_mapping=self.staged("slot_mapping", num_input_tokens),
            query_start_loc_cpu=self.query_start_loc_cpu[:num_reqs + 1],
            seq_lens_cpu=self.seq_lens_cpu[:num_reqs], uniform_decode=uniform_decode)
        md.group_metadata = self._group_metadata(md)
        return md

    def _group_metadata(self, md: AttentionMetadata) -> list[AttentionMetadata] | None:
        """Every KV cache group's metadata: `md` (group 0's) and, over the same requests, each
        other group's with its own block table and slots; None with one group."""
        if self.num_groups == 1:
            return None
        return [md] + [dataclasses.replace(
            md, block_table=self.staged(f"block_table{g}", md.num_reqs),
            slot_mapping=self.staged(f"slot_mapping{g}", md.slot_mapping.shape[0]),
            step_cache={}, group_metadata=None) for g in range(1, self.num_groups)]

    def dummy_tokens(self, n: int, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Token id 0 at each of `positions` ([n]): a warm-up's or a graph capture's inputs."""
        self.input_ids_np[:n] = 0
        self.positions_np[:n] = positions
        return self.staged("input_ids", n), self.staged("positions", n)
