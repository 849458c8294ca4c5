"""What the model runner does with a step's hidden states: sample the rows that end a request's
known tokens (grammar-masked), its prompt logprobs, or, before the last pipeline stage, hand on."""
import torch

from kiln.core.outputs import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from kiln.distributed.communication_op import broadcast_from_last_stage, send_to_next_stage
from kiln.sample.grammar_mask import bitmask_rows
from kiln.sample.logprobs import to_logprobs_lists
from kiln.sample.prompt_logprobs import PromptLogprobsChunk, compute_prompt_logprobs
from kiln.sample.sampling_metadata import SamplingMetadata, build_sampling_metadata
from kiln.spec_decode.verifier import sample_with_drafts
from kiln.worker.input_batch import CachedRequestState
from kiln.worker.step_inputs import StepInputs


class StepSampling:
    """ModelRunner's mixin for a step's end (needs its `model`, `sampler`, `requests`,
    `input_batch`, `default_generator`, `device` and `kiln_config`)."""

    def _sampling_metadata(self, states: list[CachedRequestState],
                           vocab_size: int) -> SamplingMetadata:
        return build_sampling_metadata(
            [s.sampling_params for s in states], [s.prompt_token_ids for s in states],
            [s.output_token_ids for s in states], [s.generator for s in states],
            self.default_generator, vocab_size, self.device)

    def _sample(self, so: SchedulerOutput, inputs: StepInputs,
                hidden: torch.Tensor) -> ModelRunnerOutput:
        if so.scheduled_spec_decode_tokens:
            return sample_with_drafts(self, so, inputs, hidden)
        sampled: dict[str, int] = {}
        logprobs: dict[str, LogprobsLists] = {}
        if inputs.sample_req_ids:
            states = [self.requests[r] for r in inputs.sample_req_ids]
            logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [S, V]
            meta = self._sampling_metadata(states, logits.shape[1])
            grammar = bitmask_rows(inputs.sample_req_ids, so.structured_output_request_ids,
                                   so.grammar_bitmask)
            if grammar is not None:
                meta.grammar_rows = torch.from_numpy(grammar[0]).to(self.device)
                meta.grammar_bitmask = torch.from_numpy(grammar[1]).to(self.device)
            out = self.sampler(logits, meta)
            # Earlier pipeline stages feed these tokens back as the next step's inputs.
            token_ids = broadcast_from_last_stage(out.sampled_token_ids.to(torch.int64)).tolist()
            if out.logprobs is not None:
                lists = to_logprobs_lists(out.logprob_token_ids, out.logprobs,
                                          out.sampled_ranks, meta.num_logprobs)
                logprobs = {s.req_id: lp for s, lp in zip(states, lists) if lp is not None}
            for state, token in zip(states, token_ids):
                state.output_token_ids.append(token)
                self.input_batch.append_token(state.row, token)
                sampled[state.req_id] = token

        elif self.device.type != "cpu":
            # Nothing was read back, so nothing waited for this step's copies from the pinned
            # host buffers; the next step must not overwrite them while a copy is in flight.
            torch.cuda.current_stream(self.device).synchronize()

        return ModelRunnerOutput(
            req_ids=inputs.req_ids,
            sampled_token_ids=[[sampled[r]] if r in sampled else [] for r in inputs.req_ids],
            logprobs=logprobs, prompt_logprobs=self._prompt_logprobs(inputs, hidden))

    def _finish_earlier_stage(self, inputs: StepInputs, hidden) -> ModelRunnerOutput:
        """A stage before the last: hand (hidden, residual) on, then learn the tokens the last
        stage sampled (this stage keeps each request's tokens too). One batch in flight: the
        step returns once the last stage has sampled."""
        send_to_next_stage(list(hidden))
        n = len(inputs.sample_req_ids)
        tokens = torch.empty(n, dtype=torch.int64, device=self.device)
        token_ids = broadcast_from_last_stage(tokens).tolist() if n else []
        for req_id, token in zip(inputs.sample_req_ids, token_ids):
            state = self.requests[req_id]
            state.output_token_ids.append(token)
            self.input_batch.append_token(state.row, token)
        sampled = dict(zip(inputs.sample_req_ids, token_ids))
        return ModelRunnerOutput(
            req_ids=inputs.req_ids,
            sampled_token_ids=[[sampled[r]] if r in sampled else [] for r in inputs.req_ids])

    def _prompt_logprobs(self, inputs: StepInputs,
                         hidden: torch.Tensor) -> dict[str, PromptLogprobsChunk]:
        chunks = {}
        for req_id, (where, rows) in (inputs.prompt_logprob_rows or {}).items():
            state = self.requests[req_id]
            targets = state.prompt_token_ids[where.start + 1:where.stop + 1]
            index = torch.from_numpy(rows).to(hidden.device)
            chunks[req_id] = PromptLogprobsChunk(where.start, compute_prompt_logprobs(
                self.model.compute_logits, hidden[index], targets,
                state.sampling_params.prompt_logprobs, self.kiln_config.model_config.vocab_size))
        return chunks
