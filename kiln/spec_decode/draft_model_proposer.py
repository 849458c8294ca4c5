"""vLLM's method='draft_model': a smaller model with the target's vocabulary runs in the worker
beside it (compiled under a mode-3 target, sharded over its ranks under -tp), on its own KV
tensors over the target's block tables (the worker sizes both from one budget). After each
target step it catches up on what the target computed and the token just sampled, then
proposes up to k tokens greedily (one forward over the batch each), which the scheduler runs
as drafts next step; the rejection sampler takes them as one-hot, as vLLM's does under its
default draft_sample_method='greedy'."""
import copy
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from kiln.compilation.compile_state import CompileState, set_compile_state
from kiln.config.compilation_config import CompilationConfig, CompilationMode
from kiln.config.load_config import LoadConfig
from kiln.core.outputs import SchedulerOutput
from kiln.cudagraphs.mode import CUDAGraphMode
from kiln.errors import ConfigError
from kiln.forward_context import set_forward_context
from kiln.sample.row_reductions import row_argmax
from kiln.spec_decode.scheduling import draft_lag, draft_room, target_room
from kiln.worker.step_inputs import fill_buffers


def make_drafter(kiln_config, device: torch.device):
    """The worker's proposer for --speculative-config: None without one or for n-grams (the
    scheduler proposes those)."""
    spec = kiln_config.speculative_config
    if spec is None or not spec.runner_proposes:
        return None
    if spec.is_eagle:
        from kiln.spec_decode.eagle_proposer import Eagle3Proposer, EagleProposer
        return (EagleProposer if spec.method == "eagle" else Eagle3Proposer)(kiln_config,
                                                                              device)
    return DraftModelProposer(kiln_config, device)


@dataclass
class DraftPlan:
    """Per request of the target's step (arrays in its order): its input-batch row, the
    position its step began at, the end of the positions the draft catches up on, its known
    tokens (the sampled ones included) and how many drafts it gets (0: none)."""
    rows: np.ndarray
    start: np.ndarray
    end: np.ndarray
    known: np.ndarray
    ks: np.ndarray


def draft_compiles(kiln_config) -> bool:
    """Whether the draft (a draft model or an EAGLE head) compiles: when the target runs under
    mode 3, as vLLM's does under VLLM_COMPILE, unless speculative_config.enforce_eager; under
    modes 0-2 it runs eagerly."""
    return (not kiln_config.speculative_config.enforce_eager
            and kiln_config.compilation_config.mode == CompilationMode.KILN_COMPILE)


def draft_kiln_config(kiln_config):
    """The target's engine config with the draft model in it, on the target's ranks: eager
    (mode 0, no graphs), or the target's compilation settings where draft_compiles (its cache
    key its own: KilnConfig.is_draft). Its token budget takes the catch-up's sampled token per
    request beyond the step's (the compiled range serves up to it)."""
    from kiln.config.kiln_config import KilnConfig

    draft = kiln_config.speculative_config.draft_model_config
    compiled = draft_compiles(kiln_config)
    sched = kiln_config.scheduler_config
    return KilnConfig(
        model_config=draft, cache_config=kiln_config.cache_config,
        scheduler_config=dataclasses.replace(
            sched, max_num_batched_tokens=sched.max_num_batched_tokens + sched.max_num_seqs),
        parallel_config=kiln_config.parallel_config,
        load_config=LoadConfig(load_format=draft.load_format),
        device_config=kiln_config.device_config,
        compilation_config=(copy.deepcopy(kiln_config.compilation_config) if compiled
                            else CompilationConfig(mode=CompilationMode.NONE)),
        enforce_eager=not compiled, ir_op_priority=dict(kiln_config.ir_op_priority),
        is_draft=True)


class DraftModelProposer:
    def __init__(self, kiln_config, device: torch.device):
        self.k = kiln_config.speculative_config.num_speculative_tokens
        self.max_model_len = kiln_config.model_config.max_model_len
        # the draft's own (capped) length: past it a request goes on without drafts, as vLLM
        self.draft_len = kiln_config.speculative_config.draft_model_config.max_model_len
        self.lag = draft_lag(kiln_config.speculative_config)  # 1: an EAGLE head
        self.kiln_config = draft_kiln_config(kiln_config)
        spec = kiln_config.speculative_config
        # what a load error names: the user's flag, not only a tensor of some model
        self.named = (f"--speculative-config: speculative_config.model={spec.model!r} "
                      f"(method={spec.method!r})")
        self.device = device
        self.model: torch.nn.Module | None = None
        self.attention_layers: dict = {}  # layer name -> the draft's Attention modules
        # the draft's own warm-up phase and graph mode (none: it runs without CUDA graphs)
        self.compile_state = CompileState()

    def load(self, target: torch.nn.Module | None = None) -> None:
        """Build and load the draft (`target`: the target model, which EagleProposer's head
        shares its embedding and LM head with)."""
        from kiln.model.layers.attention import attention_layers
        from kiln.model.loader import get_model

        try:
            with set_compile_state(self.compile_state):
                self.model = get_model(self.kiln_config)
        except ConfigError as e:
            raise ConfigError(f"{self.named}: {e}") from None
        self.attention_layers = attention_layers(self.model)
        self.attn_backend = next(iter(self.attention_layers.values())).backend

    @property
    def compiles(self) -> bool:
        return self.kiln_config.compilation_config.mode != CompilationMode.NONE

    def dummy_inputs(self, runner, num_tokens: int) -> tuple:
        """The draft's forward arguments for `num_tokens` dummy tokens."""
        return runner.buffers.dummy_tokens(num_tokens, np.arange(num_tokens) % self.draft_len)

    @torch.inference_mode()
    def dummy_run(self, runner, num_tokens: int) -> None:
        """A draft forward over dummy tokens without attention metadata: the warm-up that
        traces and compiles a compiled draft before serving (worker.compile_or_warm_up_model)."""
        with set_forward_context(None, self.kiln_config, layers=self.attention_layers,
                                 cudagraph_runtime_mode=CUDAGraphMode.NONE):
            self.model(*self.dummy_inputs(runner, num_tokens))

    def _forward(self, runner, rows: np.ndarray, start: np.ndarray, count: np.ndarray,
                 last: np.ndarray, input_ids: np.ndarray | None = None,
                 target_hidden: torch.Tensor | None = None
                 ) -> tuple[list[int], torch.Tensor | None]:
        """One draft forward: request i runs count[i] tokens from position start[i] (writing
        their K/V); returns the argmax after the last token of the requests `last` indexes,
        and the draft's hidden states there ([len(last), H]; an EAGLE head's next input).
        `target_hidden` [T, H]: an EAGLE head's second input, row for row."""
        buf, n = runner.buffers, rows.size
        qsl, seq_lens = fill_buffers(buf, runner.input_batch, rows, start, count,
                                     runner.block_size, input_ids)
        num_tokens = int(qsl[-1])
        md = buf.attention_metadata(num_tokens, n, int(count.max()), int(seq_lens.max()),
                                    num_tokens, bool((count == 1).all()))
        with set_forward_context(md, self.kiln_config, layers=self.attention_layers,
                                 cudagraph_runtime_mode=CUDAGraphMode.NONE):
            self.attn_backend.begin_step(md, runner.block_size)
            extra = () if target_hidden is None else (target_hidden,)
            hidden = self.model(buf.staged("input_ids", num_tokens),
                                buf.staged("positions", num_tokens), *extra)  # [T, H]
        if last.size == 0:
            return [], None
        index = torch.from_numpy(qsl[1:][last] - 1).to(hidden.device)
        hidden = hidden[index]  # [len(last), H]
        return row_argmax(self.model.compute_logits(hidden)).tolist(), hidden

    def plan(self, runner, so: SchedulerOutput, req_ids: list[str],
             sample_req_ids: list[str]) -> DraftPlan:
        """Where each request of the target's step stands for the draft (DraftPlan)."""
        batch, block_size = runner.input_batch, runner.block_size
        states = [runner.requests[r] for r in req_ids]
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        start = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64,
                            count=len(states))
        spec = so.scheduled_spec_decode_tokens
        ran = np.fromiter((so.num_scheduled_tokens[r] - len(spec.get(r, ())) for r in req_ids),
                          dtype=np.int64, count=len(states))
        known = batch.num_tokens[rows]  # the sampled tokens appended
        sampling = set(sample_req_ids)
        sampled = np.fromiter((r in sampling for r in req_ids), dtype=bool, count=len(states))
        held = batch.num_blocks[rows] * block_size  # slots the scheduler gave (lookahead too)
        # the accepted tokens and the one sampled after them (a token sampled at
        # max_model_len is never run); a partial prefill chunk: the chunk
        # (positions past the draft's length it never runs: the request drafts no more)
        end = np.minimum(np.where(sampled, known, start + ran),
                         np.minimum(held, self.draft_len))  # draft_len <= max_model_len
        # drafts at positions known.., as many as the draft's length and the slots held let it
        # run (an EAGLE head's one position behind) and the target could keep
        ks = np.where(sampled, np.minimum(self.k, draft_room(
            known, np.minimum(held, self.draft_len), self.lag)), 0)
        for i, s in enumerate(states):
            params = s.sampling_params
            if ks[i] > 0:
                ks[i] = min(ks[i], target_room(int(known[i]), len(s.output_token_ids),
                                               params.max_tokens, self.max_model_len))
            if params.structured_outputs is not None:  # decoded token by token
                ks[i] = 0
        ks = np.maximum(ks, 0)
        return DraftPlan(rows, start, end, known, ks)

    def extend(self, runner, drafts: dict[int, list[int]], plan: DraftPlan,
               hidden: torch.Tensor | None = None) -> None:
        """Steps 2..k: each request still drafting runs its last draft (one forward over the
        batch each) and appends the next. `hidden` [len(drafts), H]: an EAGLE head's state
        after each request's last draft, row for row with `drafts`."""
        rows, known, ks = plan.rows, plan.known, plan.ks
        # a request's first draft's position, less 1: the draft model runs its own token
        # there; an EAGLE head, one position behind (position i reads token i + 1)
        base = known - 1 - self.lag
        active = np.fromiter(drafts, dtype=np.int64, count=len(drafts))
        for j in range(1, self.k):
            keep = ks[active] > j
            active = active[keep]
            if active.size == 0:
                break
            if hidden is not None:
                hidden = hidden[torch.from_numpy(np.flatnonzero(keep)).to(hidden.device)]
            tokens = np.asarray([drafts[i][-1] for i in active], dtype=np.int64)
            nxt, out = self._forward(runner, rows[active], base[active] + j,
                                     np.ones(active.size, dtype=np.int64),
                                     np.arange(active.size), tokens, hidden)
            hidden = None if hidden is None else out
            for i, t in zip(active, nxt):
                drafts[int(i)].append(t)
        if self.device.type != "cpu":  # nothing may still read the host buffers next step
            torch.cuda.current_stream(self.device).synchronize()

    @torch.inference_mode()
    def propose(self, runner, so: SchedulerOutput, req_ids: list[str],
                sample_req_ids: list[str], target_hidden: torch.Tensor | None = None
                ) -> dict[str, list[int]]:
        """After the target's step: the draft's K/V for every position the target computed
        and the token it sampled, then each sampling request's proposals."""
        p = self.plan(runner, so, req_ids, sample_req_ids)
        runs = np.flatnonzero(p.end > p.start)
        if runs.size == 0:
            return {}
        proposing = np.flatnonzero(p.ks[runs] > 0)  # into `runs`
        first, _ = self._forward(runner, p.rows[runs], p.start[runs], (p.end - p.start)[runs],
                                 proposing)
        drafts = {int(runs[i]): [t] for i, t in zip(proposing, first)}
        self.extend(runner, drafts, p)
        return {req_ids[i]: d for i, d in drafts.items()}
