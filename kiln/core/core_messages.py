"""The messages between the engine front and the engine core process, and their wire format.

msgspec msgpack, no pickle: structs here, dataclasses (EngineCoreOutput, SchedulerStats) as-is.
"""
import dataclasses
import functools
import traceback
import typing
from collections.abc import Sequence
from typing import Any

import msgspec

from kiln.core.outputs import EngineCoreOutput
from kiln.core.request import Request
from kiln.core.stats import SchedulerStats
from kiln.lora.request import LoRARequest
from kiln.sampling_params import SamplingParams

# ---- front -> core ---------------------------------------------------------------------------

class EngineCoreRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any]  # encode_params(); decode_params() rebuilds it
    arrival_time: float
    cache_salt: str | None = None
    priority: int = 0
    # An n > 1 request's samples, sample i named child_ids[i]: the core makes them from this one
    # message (parent_request.py), its params sent once. Empty: the request is its own sample.
    child_ids: list[str] = []
    lora_request: list | None = None  # LoRARequest.to_wire()


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class FinishRequests(msgspec.Struct, tag=True):
    request_ids: list[str]
    status: int  # a RequestStatus


class UtilityCall(msgspec.Struct, tag=True):
    """Call an EngineCore method by name; the answer is a UtilityResult with the same call_id."""
    call_id: int
    method: str
    args: list[Any] = []


class Shutdown(msgspec.Struct, tag=True):
    pass


CoreInput = EngineCoreRequest | AbortRequests | FinishRequests | UtilityCall | Shutdown
UTILITY_METHODS = ("reset_prefix_cache", "make_stats", "get_num_unfinished_requests", "sleep",
                   "wake_up", "is_sleeping", "sleep_status", "collective_rpc")


# ---- core -> front ---------------------------------------------------------------------------

class Ready(msgspec.Struct, tag=True):
    num_blocks: int
    max_model_len: int  # lowered by the core when the KV cache cannot hold the model's
    # Start-up phases in seconds: the core process's imports, then EngineCore's own.
    timings: dict[str, float] = {}
    num_threads: int = 0  # torch's threads for steps, after any left to the front end


class StepOutputs(msgspec.Struct, tag=True):
    """One core step's outputs, with the stats taken right after it (outputs may be empty:
    an abort changed the stats)."""
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    # Input messages the core had handled when it sent this: outputs for an id the front end
    # added again later (its namesake aborted or ended by a stop string while the core ran
    # ahead) are the old request's, and the front end drops them by this count.
    inputs_handled: int = 0


class UtilityResult(msgspec.Struct, tag=True):
    call_id: int
    result: Any = None
    error: str | None = None
    failure: "CoreFailed | None" = None  # the error, to be raised as its own kind


class CoreFailed(msgspec.Struct, tag=True):
    """The core could not start, or a step raised: the process exits after sending this."""
    error_type: str  # the exception's class name, so the front raises the same kind
    message: str
    traceback: str = ""
    error_module: str = "builtins"  # where error_type is defined (a kiln module is rebuilt too)


CoreOutput = Ready | StepOutputs | UtilityResult | CoreFailed


def input_codec() -> tuple[msgspec.msgpack.Encoder, msgspec.msgpack.Decoder]:
    return msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(CoreInput)


def output_codec() -> tuple[msgspec.msgpack.Encoder, msgspec.msgpack.Decoder]:
    return msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(CoreOutput)


# ---- SamplingParams, field by field ----------------------------------------------------------

def encode_params(params: SamplingParams) -> dict[str, Any]:
    """Every dataclass field as it is (msgspec encodes nested dataclasses, enums and sets), so a
    plain field added to SamplingParams crosses without a change here."""
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}


@functools.cache
def _param_types() -> dict[str, Any]:
    return typing.get_type_hints(SamplingParams)


def decode_params(fields: dict[str, Any]) -> SamplingParams:
    """Rebuild the engine's resolved copy without __post_init__: verify() would reset
    all_stop_token_ids, which the engine front filled from the tokenizer."""
    types = _param_types()
    params = SamplingParams.__new__(SamplingParams)
    for f in dataclasses.fields(SamplingParams):
        if f.name in fields:
            value = msgspec.convert(fields[f.name], types[f.name], strict=False)
        elif f.default is not dataclasses.MISSING:
            value = f.default
        else:
            value = f.default_factory()
        setattr(params, f.name, value)
    return params


def to_wire(request: Request, child_ids: Sequence[str] = ()) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=request.request_id,
                             prompt_token_ids=list(request.prompt_token_ids),
                             sampling_params=encode_params(request.sampling_params),
                             arrival_time=request.arrival_time, cache_salt=request.cache_salt,
                             priority=request.priority, child_ids=list(child_ids),
                             lora_request=None if request.lora_request is None
                             else request.lora_request.to_wire())


def from_wire(request: EngineCoreRequest) -> Request:
    return Request(request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                   sampling_params=decode_params(request.sampling_params),
                   arrival_time=request.arrival_time, cache_salt=request.cache_salt,
                   priority=request.priority,
                   lora_request=LoRARequest.from_wire(request.lora_request))


def failure_report(e: BaseException) -> CoreFailed:
    """What a core or a rank sends back for `e` (picklable), Dynamo's BackendCompilerFailed
    unwrapped: a piece that failed to compile is reported as itself."""
    from kiln.compilation.piecewise import unwrap_backend_error

    e = unwrap_backend_error(e)
    return CoreFailed(error_type=type(e).__name__, message=str(e),
                      traceback="".join(traceback.format_exception(e)),
                      error_module=type(e).__module__)
