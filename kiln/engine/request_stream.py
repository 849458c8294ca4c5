"""`RequestStream`: one request's outputs as AsyncLLM hands them to its caller, in the kind
(DELTA, CUMULATIVE, FINAL_ONLY) its SamplingParams asked for, with its metrics timer.
"""
import asyncio

from kiln.engine.output_merge import DeltaAccumulator
from kiln.engine.request_stats import RequestTimer
from kiln.outputs import CompletionOutput, RequestOutput
from kiln.sampling_params import RequestOutputKind, SamplingParams


class RequestStream:
    """One request's outputs, in the kind its SamplingParams asked for."""

    def __init__(self, request_id: str, params: SamplingParams, arrival_time: float):
        self.request_id = request_id
        self.kind = params.output_kind
        self.n = params.n
        self.finished = False  # the consumer has taken the final output
        self._ended = False  # the final output (or an error) is queued
        self._samples_done: set[int] = set()
        self._prompt: str | None = None
        self._prompt_token_ids: list[int] = []
        self.timer = RequestTimer(arrival_time, params.n)
        self.num_prompt_tokens: int | None = None  # once the engine has read the prompt
        # The first engine step after this request's add (AsyncLLM): earlier steps' outputs
        # under its id are a namesake's. None until the engine has added it.
        self.first_step: int | None = None
        self.engine = 0  # the data-parallel replica the engine sent it to (its metrics' label)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._merged = DeltaAccumulator()  # for CUMULATIVE / FINAL_ONLY

    def accepted(self, processed) -> None:
        """The engine's reading of the request (LLMEngine.process_inputs): the prompt's length
        (what usage reports before the first output) and the max_tokens it settled on, which
        its metrics observe: the room beside the prompt where the request set none (vLLM's
        request_params_max_tokens observes that too)."""
        self.num_prompt_tokens = len(processed.prompt_token_ids)
        # for put_abort's final output (not copied: nothing changes a processed prompt's ids)
        self._prompt, self._prompt_token_ids = processed.prompt, processed.prompt_token_ids
        self.timer.max_tokens = processed.params.max_tokens

    def put_delta(self, delta: RequestOutput) -> None:
        """Feed one DELTA output from the engine; emit what this stream's kind wants."""
        self._ended = self._ended or delta.finished
        self._samples_done.update(c.index for c in delta.outputs if c.finish_reason)
        if self.kind == RequestOutputKind.DELTA:
            self._queue.put_nowait(delta)
            return
        self._merged.add(delta)
        if self.kind == RequestOutputKind.CUMULATIVE or delta.finished:
            self._queue.put_nowait(self._merged.snapshot())

    def put_error(self, error: BaseException) -> None:
        self._ended = True
        self._queue.put_nowait(error)

    def put_abort(self) -> None:
        """End the stream as aborted (AsyncLLM.abort by another caller, or before its add): a
        final output whose unfinished samples end with finish_reason "abort", as vLLM's
        (its consumer waited for good)."""
        if self._ended:
            return
        outputs = [CompletionOutput(i, "", [], finish_reason="abort") for i in range(self.n)
                   if i not in self._samples_done]
        self.put_delta(RequestOutput(self.request_id, self._prompt, self._prompt_token_ids,
                                     outputs, finished=True))

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item
