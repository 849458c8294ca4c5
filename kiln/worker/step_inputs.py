"""`StepInputs` and how the model runner fills them: a step's schedule laid into the persistent
buffers, its CUDA graph mode and padded size, and the rows whose logits are sampled."""
from dataclasses import dataclass

import numpy as np
import torch

from kiln.attention.metadata import AttentionMetadata
from kiln.core.outputs import SchedulerOutput
from kiln.cudagraphs.mode import BatchDescriptor, CUDAGraphMode
from kiln.sample.prompt_logprobs import prompt_logprob_rows
from kiln.spec_decode.verifier import num_drafts, spec_logits_indices
from kiln.worker import input_prep


@dataclass
class StepInputs:
    req_ids: list[str]  # scheduled requests, in batch order
    num_tokens: int  # real tokens this step
    num_input_tokens: int  # tokens passed to the model (>= num_tokens when padded)
    input_ids: torch.Tensor  # [num_input_tokens] int64, device
    positions: torch.Tensor  # [num_input_tokens] int64, device
    attn_metadata: AttentionMetadata
    sample_req_ids: list[str]  # requests whose step reaches their last known token
    # [len(sample_req_ids)] int64 on the device, or a slice where they are consecutive
    logits_indices: torch.Tensor | slice
    cudagraph_mode: CUDAGraphMode = CUDAGraphMode.NONE
    batch_descriptor: BatchDescriptor | None = None
    # req_id -> (positions whose hidden state predicts a prompt token, their rows): requests
    # that asked for prompt logprobs and run prompt positions this step.
    prompt_logprob_rows: dict[str, tuple[range, np.ndarray]] | None = None


def fill_buffers(buf, batch, rows: np.ndarray, num_computed: np.ndarray, num_sched: np.ndarray,
                 block_size: int, input_ids: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Lay requests (row rows[i] runs num_sched[i] tokens from position num_computed[i]) into
    the step buffers: ids (the batch's token rows unless `input_ids` [T] is given), positions,
    slots, block table, query starts and sequence lengths. Returns (query starts, seq lens)."""
    num_reqs, num_tokens = rows.size, int(num_sched.sum())
    qsl = input_prep.query_start_loc(num_sched)
    req_idx = input_prep.token_request_indices(num_sched)
    pos = input_prep.positions(num_computed, num_sched)
    buf.input_ids_np[:num_tokens] = batch.token_ids[rows[req_idx], pos] if input_ids is None \
        else input_ids
    buf.positions_np[:num_tokens] = pos
    for table, slots, batch_table in zip(buf.group_block_table_np, buf.group_slot_mapping_np,
                                         batch.block_tables):  # each KV cache group's
        table[:num_reqs] = batch_table[rows]
        slots[:num_tokens] = input_prep.slot_mapping(table, req_idx, pos, block_size)
    buf.query_start_loc_np[:num_reqs + 1] = qsl
    seq_lens = num_computed + num_sched
    buf.seq_lens_np[:num_reqs] = seq_lens
    return qsl, seq_lens


class StepInputPreparation:
    """The model runner's input preparation (ModelRunner's base): reads the runner's requests,
    input_batch, buffers, block_size, max_num_tokens and cudagraph_dispatcher."""

    def padded_num_tokens(self, num_tokens: int) -> int:
        """Tokens an eager step runs for `num_tokens` real ones: no padding (a CUDA graph's
        key sets its own size); a seam for tests of padded steps."""
        return num_tokens

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        req_ids = list(so.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        num_reqs = len(req_ids)
        batch, buf = self.input_batch, self.buffers
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=num_reqs)
        num_sched = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=num_reqs)
        num_computed = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64,
                                   count=num_reqs)
        known = batch.num_tokens[rows]
        drafts = num_drafts(so, req_ids) if so.scheduled_spec_decode_tokens else None
        if drafts is not None:  # laid after the known tokens (spec_decode/verifier.py)
            known = known + drafts
        input_prep.check_step(req_ids, num_computed, num_sched, known, batch.num_blocks[rows],
                              self.block_size)
        num_tokens = int(num_sched.sum())
        uniform_decode = bool((num_sched == 1).all())
        cg_mode, desc = self.cudagraph_dispatcher.dispatch(num_tokens, num_reqs, uniform_decode)
        # With a graph the key fixes the size; eagerly, the padded_num_tokens hook does.
        num_input = desc.num_tokens if cg_mode is not CUDAGraphMode.NONE \
            else self.padded_num_tokens(num_tokens)
        # A FULL all-decode graph was recorded for desc.num_reqs one-token requests: pad the
        # metadata with dummy requests (1 token, seq_len 1, block 0, slot -1) to match.
        md_reqs = desc.num_reqs if cg_mode is CUDAGraphMode.FULL and desc.uniform_decode \
            else num_reqs
        if num_input > self.max_num_tokens:
            raise RuntimeError(f"step of {num_input} tokens exceeds the input buffers "
                               f"(max_num_batched_tokens={self.max_num_tokens})")

        qsl, seq_lens = fill_buffers(buf, batch, rows, num_computed, num_sched, self.block_size)
        # Padding tokens: valid ids and positions, but they write no cache slot.
        buf.input_ids_np[num_tokens:num_input] = 0
        buf.positions_np[num_tokens:num_input] = 0
        buf.group_slot_mapping_np[:, num_tokens:num_input] = -1
        if md_reqs > num_reqs:
            buf.query_start_loc_np[num_reqs + 1:md_reqs + 1] = \
                num_tokens + np.arange(1, md_reqs - num_reqs + 1)
            buf.seq_lens_np[num_reqs:md_reqs] = 1
            buf.group_block_table_np[:, num_reqs:md_reqs] = 0

        samples = input_prep.sampling_mask(num_computed, num_sched, known)
        sample_rows = input_prep.logits_indices(qsl, samples) if drafts is None \
            else spec_logits_indices(qsl, samples, drafts)
        logits_rows = input_prep.as_slice(sample_rows)
        if logits_rows is None:  # rows with gaps: a tensor index on the device
            buf.logits_indices_np[:sample_rows.size] = sample_rows
            logits_rows = buf.staged("logits_indices", sample_rows.size)

        attn_metadata = buf.attention_metadata(num_tokens, md_reqs, int(num_sched.max()),
                                               int(seq_lens.max()), num_input, uniform_decode)
        return StepInputs(
            req_ids=req_ids, num_tokens=num_tokens, num_input_tokens=num_input,
            prompt_logprob_rows=prompt_logprob_rows(states, num_computed, num_sched, qsl),
            input_ids=buf.staged("input_ids", num_input),
            positions=buf.staged("positions", num_input),
            attn_metadata=attn_metadata,
            sample_req_ids=[r for r, s in zip(req_ids, samples) if s],
            logits_indices=logits_rows,
            cudagraph_mode=cg_mode, batch_descriptor=desc)
