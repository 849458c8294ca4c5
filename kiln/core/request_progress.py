"""What a step does to one request: its sampled tokens appended and checked against its grammar
and stop conditions, or the end the scheduler gave it, each as the EngineCoreOutput sent back.
"""
from kiln.core.kv_cache_manager import KVCacheManager
from kiln.core.outputs import EngineCoreOutput, ModelRunnerOutput
from kiln.core.request import Request, RequestStatus
from kiln.logger import init_logger
from kiln.repetition_detection import REPETITION_STOP_REASON, RepetitionTracker

logger = init_logger(__name__)


def check_stop(request: Request, max_model_len: int, grammar_ended: bool = False) -> bool:
    """After a token was appended: set the finished status (and stop_reason) if the request ends.
    `grammar_ended`: its grammar took the token as its end, which the sampler let win over
    min_tokens (nothing may follow a finished grammar: the request would go on unconstrained)."""
    params = request.sampling_params
    token = request.output_token_ids[-1]
    if ((request.num_output_tokens >= params.min_tokens or grammar_ended)
            and token in params.all_stop_token_ids):
        request.status = RequestStatus.FINISHED_STOPPED
        # As in vLLM: an explicit stop token is reported, the end-of-sequence token is not
        # (also where stop_token_ids lists it, unless ignore_eos made it an ordinary token).
        explicit = token in params.stop_token_ids and token != params.eos_stop_token_id
        request.stop_reason = token if explicit else None
    elif params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    elif request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    elif _repeats(request) and request.num_output_tokens >= params.min_tokens:
        request.status = RequestStatus.FINISHED_REPETITION
        request.stop_reason = REPETITION_STOP_REASON
    else:
        return False
    return True


def _repeats(request: Request) -> bool:
    """Whether its output ends in a repetition (repetition_detection); every token is taken,
    those before min_tokens too, so the check after them is as vLLM's on the whole output."""
    params = request.sampling_params.repetition_detection
    if params is None or not params.enabled:
        return False
    if request.repetition_tracker is None:
        request.repetition_tracker = RepetitionTracker(params)
    return request.repetition_tracker.update(request.output_token_ids)


def append_sampled(request: Request, sampled: list[int],
                   max_model_len: int) -> tuple[list[int], str | None]:
    """Append a step's sampled tokens to `request` until one ends it (request.is_finished()
    then says so). Returns the tokens appended and, where its grammar allowed none of them,
    the error that ended it."""
    new_token_ids = []
    grammar = request.structured_output_request
    for token in sampled:
        if grammar is not None and not grammar.accept(token):
            # Its grammar allowed no token: what was drawn is no output, and the request
            # ends (abort), as one whose grammar fails to compile does.
            error = (f"{grammar.spec.field} allows no token after "
                     f"{request.num_output_tokens} generated token(s); check that the "
                     "constraint can be satisfied")
            logger.error("request %s: %s; ending it", request.request_id, error)
            request.status = RequestStatus.FINISHED_ABORTED
            return new_token_ids, error
        request.output_token_ids.append(token)
        new_token_ids.append(token)
        if check_stop(request, max_model_len, grammar is not None and grammar.ended):
            break
    return new_token_ids, None


def step_output(request: Request, runner_output: ModelRunnerOutput, row: int | None,
                max_model_len: int) -> EngineCoreOutput | None:
    """Take a scheduled request's part of the runner's output (`row`: its place there, None if
    it has none): its prompt logprobs, then its sampled tokens. Returns its output for the
    step, None for a partial prefill chunk (nothing to report yet)."""
    req_id = request.request_id
    chunk = runner_output.prompt_logprobs.get(req_id)
    if chunk is not None and request.prompt_logprobs is not None:
        request.add_prompt_logprobs(chunk.start, chunk.entries)
    pooled = runner_output.pooler_output.get(req_id)
    if pooled is not None:
        return pooled_output(request, pooled)
    sampled = runner_output.sampled_token_ids[row] if row is not None else []
    if not sampled:
        if request.num_computed_tokens >= request.num_tokens:
            raise RuntimeError(f"request {req_id!r} finished its prefill but the runner "
                               "returned no sampled token for it")
        return None
    new_token_ids, error = append_sampled(request, sampled, max_model_len)
    logprobs = runner_output.logprobs.get(req_id) if new_token_ids else None
    if logprobs is not None:  # one per token, those a stop did not cut off
        logprobs = (logprobs if isinstance(logprobs, list) else [logprobs])[:len(new_token_ids)]
    return EngineCoreOutput(
        request_id=req_id, new_token_ids=new_token_ids,
        new_logprobs=logprobs or [],
        finish_reason=request.get_finish_reason(), stop_reason=request.stop_reason,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        prompt_logprobs=request.take_prompt_logprobs(),
        first_scheduled_time=request.first_scheduled_time, error=error)


def pooled_output(request: Request, pooled: list[float]) -> EngineCoreOutput:
    """A pooling request ends with its prefill: its pooled vector, no token (vLLM's "stop")."""
    request.status = RequestStatus.FINISHED_STOPPED
    return EngineCoreOutput(
        request_id=request.request_id, new_token_ids=[], finish_reason="stop",
        num_cached_tokens=max(request.num_cached_tokens, 0),
        first_scheduled_time=request.first_scheduled_time, pooling_output=pooled)


def unschedulable_output(request: Request, num_tokens: int, kv: KVCacheManager,
                         max_model_len: int, larger_cache_flags: str) -> EngineCoreOutput:
    """End a request the cache can never hold, instead of letting it block the queue."""
    capacity = kv.num_blocks * kv.block_size
    # With output already produced, running out of room is a length limit; otherwise abort.
    request.status = (RequestStatus.FINISHED_LENGTH_CAPPED if request.num_output_tokens
                      else RequestStatus.FINISHED_ABORTED)
    error = (f"the request needs {num_tokens} tokens of KV cache (max_model_len="
             f"{max_model_len}) but the cache holds {capacity}; raise "
             f"{larger_cache_flags} or lower --max-model-len")
    logger.error("request %s: %s; ending it as %s", request.request_id, error,
                 request.get_finish_reason())
    return EngineCoreOutput(
        request_id=request.request_id, new_token_ids=[],
        finish_reason=request.get_finish_reason(),
        num_cached_tokens=max(request.num_cached_tokens, 0),
        first_scheduled_time=request.first_scheduled_time,
        error=error if request.status == RequestStatus.FINISHED_ABORTED else None)


def grammar_error_output(request: Request) -> EngineCoreOutput:
    """The front end checks every grammar, so a compile failing here is rare (an xgrammar
    limit of the vocabulary): end the request (abort) and say why, leaving the rest be."""
    request.status = RequestStatus.FINISHED_ABORTED
    logger.error("request %s: %s; ending it", request.request_id,
                 request.structured_output_request.error)
    return EngineCoreOutput(
        request_id=request.request_id, new_token_ids=[],
        finish_reason=request.get_finish_reason(), num_cached_tokens=0,
        first_scheduled_time=request.first_scheduled_time,
        error=request.structured_output_request.error)
