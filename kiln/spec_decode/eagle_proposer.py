"""vLLM's method='eagle': an EAGLE-1 head (kiln/model/llama_eagle.py) drafts from the target's
last hidden states. It runs as the draft model does (draft_model_proposer.py: its own K/V over
the target's block tables, greedy proposals; compiled under a mode-3 target), one position
behind: head position i reads token i + 1 and the target's hidden state at i, so after each
target step it catches up on the positions whose next token is known, then feeds its own output
hidden state to the next draft. method='eagle3' (Eagle3Proposer, kiln/model/llama_eagle3.py)
reads the target's auxiliary hidden states from 3 layers instead, folded by the head's fc, and
drafts over its own vocabulary.
"""
import numpy as np
import torch

from kiln.core.outputs import SchedulerOutput
from kiln.spec_decode.draft_model_proposer import DraftModelProposer
from kiln.worker import input_prep


class EagleProposer(DraftModelProposer):
    def load(self, target: torch.nn.Module | None = None) -> None:
        super().load()
        self.model.share_target(target)

    def dummy_inputs(self, runner, num_tokens: int) -> tuple:
        """Dummy tokens and a zero hidden state per token ([T, the head's hidden size])."""
        hf = self.kiln_config.model_config
        zeros = torch.zeros(num_tokens, hf.hidden_size, dtype=hf.torch_dtype, device=self.device)
        return (*super().dummy_inputs(runner, num_tokens), zeros)

    def head_input(self, states: torch.Tensor) -> torch.Tensor:
        """The target's states at the caught-up positions -> the head's hidden input [T, H]."""
        return states

    @torch.inference_mode()
    def propose(self, runner, so: SchedulerOutput, req_ids: list[str],
                sample_req_ids: list[str], target_hidden: torch.Tensor | None = None
                ) -> dict[str, list[int]]:
        """target_hidden [T, H]: the target's last hidden states of this step (EAGLE-3: its
        auxiliary states, [T, 3H]), its requests' scheduled tokens (drafts included) in
        `req_ids` order."""
        p = self.plan(runner, so, req_ids, sample_req_ids)
        # positions start..end-2 (the last one's next token is the one just sampled); a
        # prefill chunk's last position reads the next prompt token
        end = np.minimum(p.end, p.known - 1)
        count = np.maximum(end - p.start, 0)
        runs = np.flatnonzero(count > 0)
        if runs.size == 0:
            return {}
        scheduled = np.fromiter((so.num_scheduled_tokens[r] for r in req_ids), dtype=np.int64,
                                count=len(req_ids))
        step_start = input_prep.query_start_loc(scheduled)[:-1]  # each request's first row
        start, n = p.start[runs], count[runs]
        pos = input_prep.positions(start, n)  # [T]
        offsets = np.repeat(step_start[runs] - start, n)
        index = torch.from_numpy(offsets + pos).to(target_hidden.device)
        token_ids = runner.input_batch.token_ids[np.repeat(p.rows[runs], n), pos + 1]
        proposing = np.flatnonzero(p.ks[runs] > 0)  # into `runs` (their end is known - 1)
        first, hidden = self._forward(runner, p.rows[runs], start, n, proposing, token_ids,
                                      self.head_input(target_hidden[index]))
        drafts = {int(runs[i]): [t] for i, t in zip(proposing, first)}
        self.extend(runner, drafts, p, hidden)
        return {req_ids[i]: d for i, d in drafts.items()}


class Eagle3Proposer(EagleProposer):
    """target_hidden: the target's auxiliary states [T, 3H] (ModelRunner.aux_layers)."""

    def head_input(self, states: torch.Tensor) -> torch.Tensor:
        return self.model.combine_hidden_states(states)  # [T, H]
