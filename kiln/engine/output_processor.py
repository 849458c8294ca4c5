"""Turns the core's per-step EngineCoreOutputs into the RequestOutputs users see.

Owns each request's detokenizer, stop-string checks, logprobs, and the fan-in of n > 1 samples
(child core requests) into one RequestOutput per user request, per output kind.
"""
from dataclasses import dataclass, field

from kiln.core.outputs import EngineCoreOutput, LogprobsLists
from kiln.engine.detokenizer import IncrementalDetokenizer, decode_anchor, lone_token_text
from kiln.engine.stop_string_steps import update_until_stop
from kiln.engine.stream_detokenizer import NoTextDetokenizer, detokenizer_for_request
from kiln.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kiln.sampling_params import RequestOutputKind, SamplingParams


def to_logprob_dict(lists: LogprobsLists, decode) -> dict[int, Logprob]:
    """The sampled token (with its rank) first, then the top-N by rank. A sampled token among
    the top-N takes its top-N position as its rank, as vLLM's dict of [sampled, top...] (a later
    key wins): under a tie its counted rank (ties against it) is worse than its position."""
    sampled, sampled_lp = lists.token_ids[0], lists.logprobs[0]
    out = {sampled: Logprob(sampled_lp, lists.sampled_rank, decode(sampled))}
    for rank, (tid, lp) in enumerate(zip(lists.token_ids[1:], lists.logprobs[1:]), start=1):
        out[tid] = Logprob(lp, rank, decode(tid))
    return out


def _seen_tokens(state, out: EngineCoreOutput, had: int, has: int) -> tuple[str, int, int]:
    """(user request id, prompt, generated tokens) one output showed the user, as the server's
    metrics count them: a sample's prompt with its first tokens (a pooling request's with its
    vector), and the tokens kept: a stop string inside a step's accepted drafts cuts the rest."""
    if out.pooling_output is not None:
        return state.request_id, len(state.prompt_token_ids), 0
    prompt = len(state.prompt_token_ids) if had == 0 and has > 0 else 0
    return state.request_id, prompt, has - had


def _no_text(token_id: int) -> None:
    """Logprob token text of a request with detokenize=False: none, as vLLM's."""
    return None


@dataclass
class SampleState:
    """One core request: sample `index` of a user request."""
    core_id: str
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | NoTextDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    # Tokens / logprobs not yet sent (DELTA) and whether this sample changed this step.
    num_sent_tokens: int = 0
    updated: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def completion(self, delta: bool) -> CompletionOutput:
        start = self.num_sent_tokens if delta else 0
        text = self.detokenizer.get_next_output_text(self.finished, delta)
        if delta:
            self.num_sent_tokens = len(self.token_ids)
        return CompletionOutput(
            index=self.index, text=text, token_ids=self.token_ids[start:],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else self.logprobs[start:],
            finish_reason=self.finish_reason, stop_reason=self.stop_reason, error=self.error)


@dataclass
class RequestState:
    """One user request and its samples (one per n)."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    samples: list[SampleState]
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None  # PromptLogprobs, once the core has sent them
    prompt_logprobs_sent: bool = False  # DELTA outputs carry them once
    metrics: RequestMetrics | None = None  # immutable: replaced, never changed under a reader
    pooled: list[float] | None = None  # a pooling request's vector (kiln/pooling/)
    lora_request: object = None  # the request's LoRARequest (kiln/lora/); None: base model

    def note_scheduled(self, index: int, first_scheduled_time: float) -> None:
        """Sample `index`'s first scheduling (every output of it repeats the stamp); the
        request's is its earliest sample's."""
        times = (self.metrics.sample_first_scheduled_times if self.metrics is not None
                 else (None,) * len(self.samples))
        if times[index] is not None:
            return
        times = times[:index] + (first_scheduled_time,) + times[index + 1:]
        self.metrics = RequestMetrics(
            first_scheduled_time=min(t for t in times if t is not None),
            sample_first_scheduled_times=times)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def make_output(self) -> RequestOutput | None:
        finished = self.finished
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = self.output_kind == RequestOutputKind.DELTA
        chosen = [s for s in self.samples if s.updated] if delta else self.samples
        for s in self.samples:
            s.updated = False
        if not chosen:
            return None
        if self.pooled is not None:
            from kiln.pooling.outputs import pooled_request_output
            return pooled_request_output(self.request_id, self.pooled, self.prompt_token_ids,
                                         self.num_cached_tokens, self.metrics)
        prompt_logprobs = self.prompt_logprobs
        if delta and self.prompt_logprobs_sent:
            prompt_logprobs = None
        self.prompt_logprobs_sent = self.prompt_logprobs is not None
        return RequestOutput(request_id=self.request_id, prompt=self.prompt,
                             prompt_token_ids=self.prompt_token_ids,
                             outputs=[s.completion(delta) for s in chosen], finished=finished,
                             num_cached_tokens=self.num_cached_tokens,
                             prompt_logprobs=prompt_logprobs, metrics=self.metrics,
                             lora_request=self.lora_request)


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    # Core requests that hit a stop string: the engine finishes them (stopped) to free blocks.
    reqs_to_finish: list[str]
    # Per core output, in order: (user request id, prompt, generated) tokens the user saw from
    # it (its prompt with a sample's first tokens; only the tokens a stop string let through),
    # or None for one the user never sees (aborted, or late tokens of a sample a stop string
    # ended).
    seen_tokens: list[tuple[str, int, int] | None] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.samples: dict[str, tuple[RequestState, SampleState]] = {}  # by core request id
        # Each logprob entry names its token's text; a prompt's top-k logprobs decode thousands
        # of ids, mostly the same few, one tokenizer call each. The text of a lone token id
        # does not depend on its neighbours, so it is decoded once (at most a vocabulary).
        self._token_texts: dict[int, str] = {}
        self._anchor = decode_anchor(tokenizer) if tokenizer is not None else None

    def _decode_token(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = lone_token_text(self.tokenizer, token_id,
                                                                 self._anchor)
        return text

    def _has_text(self, sample: "SampleState") -> bool:
        return sample.params.detokenize and self.tokenizer is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    samples: list[tuple[str, SamplingParams]],
                    output_kind: RequestOutputKind) -> None:
        """Track a user request; `samples` is (core request id, params) for each of its n."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        states = []
        for index, (core_id, params) in enumerate(samples):
            detok = detokenizer_for_request(
                self.tokenizer, prompt_token_ids, detokenize=params.detokenize,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens)
            want_logprobs = params.logprobs is not None
            states.append(SampleState(core_id=core_id, index=index, params=params,
                                      detokenizer=detok,
                                      logprobs=[] if want_logprobs else None,
                                      cumulative_logprob=0.0 if want_logprobs else None))
        state = RequestState(request_id, prompt, list(prompt_token_ids), output_kind, states)
        self.requests[request_id] = state
        for s in states:
            self.samples[s.core_id] = (state, s)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget user requests; returns the unfinished core request ids to abort in the core."""
        core_ids = []
        for rid in request_ids:
            state = self.requests.pop(rid, None)
            if state is None:
                continue
            for s in state.samples:
                self.samples.pop(s.core_id, None)
                if not s.finished:
                    core_ids.append(s.core_id)
        return core_ids

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        touched: dict[str, RequestState] = {}
        to_abort: list[str] = []
        seen: list[tuple[str, int, int] | None] = []
        for out in outputs:
            entry = self.samples.get(out.request_id)
            if entry is None or entry[1].finished:
                # aborted, or finished by a stop string (one of n samples, or a batch holding
                # several core steps of it): the core's late tokens
                seen.append(None)
                continue
            state, sample = entry
            had = len(sample.token_ids)
            if self._update_sample(sample, out):
                to_abort.append(sample.core_id)
            seen.append(_seen_tokens(state, out, had, len(sample.token_ids)))
            if out.first_scheduled_time is not None:
                state.note_scheduled(sample.index, out.first_scheduled_time)
            if out.num_cached_tokens and sample.index == 0:
                state.num_cached_tokens = out.num_cached_tokens
            # Every sample computes them (each may start first); the first to arrive is kept.
            if out.prompt_logprobs is not None and state.prompt_logprobs is None:
                decode = self._decode_token if self._has_text(sample) else _no_text
                state.prompt_logprobs = [None] + [to_logprob_dict(lists, decode)
                                                  for lists in out.prompt_logprobs]
            if out.pooling_output is not None:
                state.pooled = out.pooling_output
            touched[state.request_id] = state
        results = []
        for state in touched.values():
            result = state.make_output()
            if result is not None:
                results.append(result)
            if state.finished:
                del self.requests[state.request_id]
                for s in state.samples:
                    self.samples.pop(s.core_id, None)
        return ProcessedOutputs(results, to_abort, seen)

    def _update_sample(self, sample: SampleState, out: EngineCoreOutput) -> bool:
        """Apply one core output; True if a stop string ended a request the core still runs."""
        new_ids = list(out.new_token_ids)
        sample.updated = True
        # The text of the eos / stop token that ended the request is not part of the output
        # unless include_stop_str_in_output keeps it; the text before it is searched for stop
        # strings either way.
        detok_ids = new_ids
        ended_by_token = out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
        keeps_stop_token = ended_by_token and bool(new_ids)
        if keeps_stop_token and not sample.params.include_stop_str_in_output:
            detok_ids, keeps_stop_token = new_ids[:-1], False
        stop_str, kept = None, len(new_ids)
        if sample.params.detokenize:  # else the text stays "" (stop strings are refused)
            stop_str, kept = update_until_stop(sample.detokenizer, detok_ids, out.finished,
                                               keeps_stop_token)
            if stop_str is None:
                kept = len(new_ids)  # (the stop token left out of detok_ids is output)
        sample.token_ids.extend(new_ids[:kept])
        if sample.logprobs is not None:
            decode = self._decode_token if self._has_text(sample) else _no_text
            for lists in out.new_logprobs[:kept]:
                sample.logprobs.append(to_logprob_dict(lists, decode))
                sample.cumulative_logprob += lists.logprobs[0]
        if stop_str is not None:
            sample.finish_reason, sample.stop_reason = "stop", stop_str
            return not out.finished
        if out.finished:
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
            sample.error = out.error
        return False
