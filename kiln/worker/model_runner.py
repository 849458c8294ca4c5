"""`ModelRunner`: turns a `SchedulerOutput` into tensors, runs the model, samples.

It keeps its own per-request state (tokens, blocks, generator), fills persistent input buffers
each step (`step_inputs.py`), and calls the model through `_run_model`, the seam for compile and
CUDA graphs.
"""
import numpy as np
import torch

from kiln.attention.backend import AttentionBackend
from kiln.attention.metadata import AttentionMetadata
from kiln.compilation.compile_state import CompileState, set_compile_state
from kiln.config.eagle3_config import target_aux_layer_ids
from kiln.core.kv_cache_groups import kv_cache_groups_of
from kiln.core.kv_cache_utils import cdiv
from kiln.core.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput, SchedulerOutput
from kiln.cudagraphs.capture import setup_cudagraphs
from kiln.cudagraphs.mode import BatchDescriptor, CUDAGraphMode
from kiln.cudagraphs.wrapper import wrap_model_for_full_cudagraph
from kiln.distributed.parallel_state import get_pp_group
from kiln.distributed.stage_inputs import StageInputs
from kiln.forward_context import set_forward_context
from kiln.logger import init_logger
from kiln.lora.manager import attach_lora
from kiln.sample.sampler import Sampler
from kiln.spec_decode.draft_model_proposer import make_drafter
from kiln.spec_decode.verifier import write_drafts
from kiln.worker.input_batch import CachedRequestState, InputBatch
from kiln.worker.step_buffers import StepBuffers
from kiln.worker.step_inputs import StepInputPreparation
from kiln.worker.step_sampling import StepSampling

logger = init_logger(__name__)


class ModelRunner(StepSampling, StepInputPreparation):
    def __init__(self, kiln_config, device: torch.device):
        self.kiln_config = kiln_config
        self.device = device
        sched, cache = kiln_config.scheduler_config, kiln_config.cache_config
        self.block_size = cache.block_size
        self.max_model_len = kiln_config.model_config.max_model_len
        self.max_num_reqs = sched.max_num_seqs
        self.max_num_tokens = sched.max_num_batched_tokens  # the step buffers' length
        self.max_blocks_per_req = cdiv(self.max_model_len, self.block_size)

        self.model: torch.nn.Module | None = None
        self.lora_manager = None  # a kiln.lora.manager.LoRAManager under --enable-lora
        self.attn_backend: type[AttentionBackend] = AttentionBackend
        self.attention_layers: dict = {}  # layer name -> Attention, filled by load_model
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        # the scheduler's KV cache groups: a block table per group (kiln/core/kv_cache_groups.py)
        self.num_kv_groups = len(kv_cache_groups_of(kiln_config).groups)
        self.input_batch = InputBatch(self.max_num_reqs, self.max_model_len,
                                      self.max_blocks_per_req, self.num_kv_groups)
        # Generators of preempted seeded requests, so a resumed request continues its stream.
        self._parked_generators: dict[str, torch.Generator] = {}
        self.default_generator = torch.Generator(device=device)
        self.default_generator.manual_seed(kiln_config.model_config.seed)
        # A draft model or EAGLE head (kiln/spec_decode/), None without one.
        self.drafter = make_drafter(kiln_config, device)
        # The target layers whose hidden states an EAGLE-3 head reads (the model then returns
        # (hidden, aux)); () otherwise
        self.aux_layers = target_aux_layer_ids(kiln_config)
        # The draft's catch-up runs a step's tokens and each request's sampled one: a row more
        self.buffers = StepBuffers(self.max_num_tokens + (self.max_num_reqs if self.drafter
                                                          else 0),
                                   self.max_num_reqs, self.max_blocks_per_req, device,
                                   self.num_kv_groups)
        # Before the model compiles: the piecewise backend reads the resolved mode.
        self.cudagraph_dispatcher = setup_cudagraphs(kiln_config)
        # This engine's compile stack state (warm-up phase, the resolved graph mode).
        self.compile_state = CompileState(cudagraph_mode=self.cudagraph_dispatcher.cudagraph_mode)
        self._cudagraph_step: tuple[CUDAGraphMode, BatchDescriptor | None] = \
            (CUDAGraphMode.NONE, None)
        self.stage = get_pp_group()  # this rank's pipeline group (size 1 without PP)
        # --runner pooling: steps pool hidden states instead of sampling (kiln/pooling/).
        self.pooler = None
        if kiln_config.model_config.runner_type == "pooling":
            from kiln.pooling.runner_pooler import RunnerPooler
            self.pooler = RunnerPooler(kiln_config.model_config.pooler_config, device)

    # ---- model ---------------------------------------------------------------------------
    def load_model(self) -> None:
        from kiln.model.layers.attention import attention_layers
        from kiln.model.loader import get_model

        with set_compile_state(self.compile_state):
            model = get_model(self.kiln_config)
        if self.aux_layers:  # before the first call traces the graph
            model.set_aux_hidden_state_layers(self.aux_layers)
        # LoRA buffers join the layers before the first (tracing) call (kiln/lora/)
        self.lora_manager = attach_lora(model, self.kiln_config, self.max_num_tokens,
                                        self.device)
        self.model = wrap_model_for_full_cudagraph(model, self.compile_state.cudagraph_mode)
        if self.pooler is not None:
            self.pooler.attach(model)  # a classifier's score head
        self.stage_inputs = StageInputs(self.kiln_config.model_config.hf_config.hidden_size,
                                        self.kiln_config.model_config.torch_dtype)
        self.attention_layers = attention_layers(model)  # layer name -> Attention
        # The layers' attention backend (one for all), whose per-step work runs before them.
        layers = self.attention_layers
        self.attn_backend = next(iter(layers.values())).backend if layers else AttentionBackend
        if self.drafter is not None:
            self.drafter.load(model)

    def _run_model(self, input_ids: torch.Tensor, positions: torch.Tensor,
                   attn_metadata: AttentionMetadata | None, num_tokens: int) -> torch.Tensor:
        """One forward of the model over `num_tokens` (possibly padded) tokens -> hidden
        [num_tokens, H], as the graph the dispatcher chose for this step (self._cudagraph_step:
        (mode, descriptor), set by execute_model; NONE for dummy runs)."""
        mode, desc = self._cudagraph_step
        with set_forward_context(attn_metadata, self.kiln_config, layers=self.attention_layers,
                                 batch_descriptor=desc,
                                 cudagraph_runtime_mode=mode):
            if attn_metadata is not None:
                self.attn_backend.begin_step(attn_metadata, self.block_size)
            if self.stage.is_first_rank:
                return self.model(input_ids, positions)
            # A later pipeline stage: the previous stage's (hidden, residual); zeros in dummy
            # runs, which every stage makes on its own.
            hidden, residual = (self.stage_inputs.recv(num_tokens, self.device)
                                if attn_metadata is not None
                                else self.stage_inputs.zeros(num_tokens, self.device))
            return self.model(input_ids, positions, hidden, residual)

    @torch.inference_mode()
    def dummy_run(self, num_tokens: int) -> torch.Tensor:
        """A forward over `num_tokens` dummy tokens without attention metadata (warm-up and
        memory profiling: no KV cache reads or writes)."""
        if not 1 <= num_tokens <= self.max_num_tokens:
            raise ValueError(f"dummy run of {num_tokens} tokens outside [1, "
                             f"max_num_batched_tokens={self.max_num_tokens}]")
        input_ids, positions = self.buffers.dummy_tokens(
            num_tokens, np.arange(num_tokens) % self.max_model_len)
        out = self._run_model(input_ids, positions, None, num_tokens)
        return out[0] if self.aux_layers else out

    @torch.inference_mode()
    def profile_run(self) -> None:
        """The largest step the engine can take: a full token budget forward, then logits and
        sampling for max_num_seqs requests (peak activation memory)."""
        hidden = self.dummy_run(self.max_num_tokens)
        if not self.stage.is_last_rank:
            return
        n = min(self.max_num_reqs, self.max_num_tokens)
        logits = self.model.compute_logits(hidden[:n])
        logits.softmax(dim=1).argmax(dim=1)

    # ---- state ---------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self.input_batch.remove(state.row)
                if req_id in so.preempted_req_ids and state.generator is not None:
                    self._parked_generators[req_id] = state.generator
            if req_id not in so.preempted_req_ids:
                self._parked_generators.pop(req_id, None)

        for new in so.scheduled_new_reqs:
            if new.req_id in self.requests:  # re-sent after preemption without a forget
                self.input_batch.remove(self.requests.pop(new.req_id).row)
            params = new.sampling_params
            generator = self._parked_generators.pop(new.req_id, None)
            if generator is None and params.seed is not None:
                generator = torch.Generator(device=self.device)
                # torch takes 64 bits; its CPU generator keeps the low 32 (seeds 2**32 apart
                # share a stream there, as in vLLM on CPU). An n > 1 request's samples add
                # their index.
                generator.manual_seed(params.seed % 2 ** 64)
            state = CachedRequestState(
                req_id=new.req_id, prompt_token_ids=list(new.prompt_token_ids),
                output_token_ids=list(new.output_token_ids), sampling_params=params,
                generator=generator, block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens, lora_request=new.lora_request,
                group_block_ids=[list(ids) for ids in new.group_block_ids])
            self.input_batch.add(state)
            self.requests[new.req_id] = state

        cached = so.scheduled_cached_reqs
        group_ids = cached.new_group_block_ids or [[]] * len(cached.req_ids)
        for req_id, new_blocks, num_computed, new_group_blocks in zip(
                cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, group_ids):
            state = self.requests.get(req_id)
            if state is None:
                raise RuntimeError(f"scheduler sent cached request {req_id!r} the model runner "
                                   "does not hold (was it sent as a new request?)")
            state.num_computed_tokens = num_computed
            if new_blocks:
                state.block_ids.extend(new_blocks)
                for ids, new_ids in zip(state.group_block_ids, new_group_blocks):
                    ids.extend(new_ids)
                self.input_batch.append_block_ids(state.row, new_blocks, new_group_blocks)

    # ---- step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0 or not so.num_scheduled_tokens:
            return EMPTY_MODEL_RUNNER_OUTPUT
        if so.scheduled_spec_decode_tokens:
            write_drafts(self, so)
        inputs = self._prepare_inputs(so)
        if self.lora_manager is not None:
            self.lora_manager.prepare_step([self.requests[r].lora_request for r in inputs.req_ids],
                                           [so.num_scheduled_tokens[r] for r in inputs.req_ids])
        self._cudagraph_step = (inputs.cudagraph_mode, inputs.batch_descriptor)
        try:
            out = self._run_model(inputs.input_ids, inputs.positions, inputs.attn_metadata,
                                  inputs.num_input_tokens)
        finally:
            self._cudagraph_step = (CUDAGraphMode.NONE, None)
        # [num_input_tokens, H]; EAGLE-3's [num_input_tokens, 3H]
        hidden, aux = out if self.aux_layers else (out, None)
        if not self.stage.is_last_rank:
            return self._finish_earlier_stage(inputs, hidden)
        if self.pooler is not None:
            return self.pooler.step(so, inputs.req_ids, hidden, self.requests)

        # A step that raises past its draws is undone and recomputed (EngineCore.step): the
        # seeded requests' generators must then draw the same numbers again.
        seeded = [g for g in (self.requests[r].generator for r in inputs.sample_req_ids)
                  if g is not None]
        drawn_from = [g.get_state() for g in seeded]
        try:
            output = self._sample(so, inputs, hidden)
        except BaseException:
            for generator, state in zip(seeded, drawn_from):
                generator.set_state(state)
            raise
        if self.drafter is not None:  # an EAGLE-3 head reads the auxiliary states
            output.spec_token_ids = self.drafter.propose(
                self, so, inputs.req_ids, inputs.sample_req_ids, hidden if aux is None else aux)
        return output
