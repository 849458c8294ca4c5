"""What the pooling routes share (/v1/embeddings, /pooling, /classify, /score, /rerank): the
runner and task a route needs (vLLM's 400 otherwise), the model a request names, and running
its prompts to their pooled outputs, every prompt checked before any is queued."""
import asyncio
import secrets
import time

from starlette.requests import Request

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.serving_engine import check_num_sequences, until_disconnect
from kiln.entrypoints.openai.serving_models import ServingModels
from kiln.pooling.outputs import PoolingParams
from kiln.pooling.pooling_inputs import process_pooling
from kiln.sampling_params import RequestOutputKind, SamplingParams

# what serves each task, for the refusals
_SERVES = {"embed": "--runner pooling (or --task embed) on a *ForCausalLM checkpoint",
           "classify": "a *ForSequenceClassification checkpoint (or --runner pooling "
                       "--convert classify)"}
_FIELDS = ("dimensions", "truncate_prompt_tokens", "priority", "text_1", "text_2", "data_1",
           "data_2", "queries", "documents", "items", "query")


def pooling_task(llm: AsyncLLM) -> str | None:
    """The server's pooling task ("embed" or "classify"), None on a generate server."""
    model_config = llm.kiln_config.model_config
    if model_config.runner_type != "pooling":
        return None
    return model_config.pooler_config.task


def refuse_task(api: str, task: str | None, needs: str) -> OpenAIError:
    """vLLM's answer (400) to a pooling route the server's runner or task does not serve."""
    runs = ("the generate runner" if task is None else
            f"the pooling runner's {task} task")
    return OpenAIError(f"The model does not support {api} API: this server runs {runs}; "
                       f"start it with {_SERVES[needs]} to serve it",
                       code="unsupported_endpoint")


def resolve_model(models: ServingModels, model: str | None, path: str) -> str:
    name = models.resolve(model)
    if models.lora_request(name) is not None:  # else the base model's output, silently
        raise OpenAIError(f"`model` {name!r} is a LoRA adapter; {path} does not apply LoRA "
                          f"adapters yet: ask for the base model {models.default_name!r}",
                          param="model", code="unsupported_parameter")
    return name


def field_error(e: ValueError, prompt_param: str = "input") -> OpenAIError:
    """A pooling prompt's refusal (ValueError) as a 400 naming the request field."""
    message = str(e)
    param = next((f for f in _FIELDS if message.startswith(f)), prompt_param)
    code = "context_length_exceeded" if "maximum context length" in message else "invalid_value"
    return OpenAIError(message.replace("prompt", prompt_param, 1) if message.startswith("prompt")
                       else message, param=param, code=code)


def usage(num_tokens: int) -> dict:
    return {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0,
            "prompt_tokens_details": None}


async def pool(llm: AsyncLLM, raw: Request, request_id: str, prompts: list,
               params: PoolingParams, priority: int, prompt_param: str = "input",
               num_sequences: int | None = None) -> list:
    """The engine's finished outputs (`.pooled`) of every prompt, in order; raises
    ClientDisconnected when the client goes away (its requests aborted). `num_sequences`:
    what the --max-sequences-per-request cap counts (default: the prompts; scoring counts
    its pairs, which an embedding model pools as both sides' texts)."""
    check_num_sequences(len(prompts) if num_sequences is None else num_sequences, 1,
                        llm.max_sequences_per_request, prompt_param)
    return await until_disconnect(raw, _run(llm, request_id, prompts, params, priority,
                                            prompt_param))


async def _run(llm: AsyncLLM, request_id: str, prompts: list, params: PoolingParams,
               priority: int, prompt_param: str) -> list:
    try:
        processed = [await llm.run_in_engine(process_pooling, llm.engine, p, params)
                     for p in prompts]
    except ValueError as e:
        raise field_error(e, prompt_param) from None
    base_id = f"{request_id}-{secrets.token_hex(4)}"
    stream_params = SamplingParams(max_tokens=1, detokenize=False)
    stream_params.output_kind = RequestOutputKind.DELTA  # one output: the final
    arrival = time.monotonic()
    streams = []
    try:
        for i, (prompt, item) in enumerate(zip(prompts, processed)):
            item.params.output_kind = RequestOutputKind.DELTA
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            streams.append(await llm.add_request(rid, prompt, stream_params, arrival,
                                                 processed=item, priority=priority))
        return await asyncio.gather(*(_final(s) for s in streams))
    except ValueError as e:
        raise field_error(e, prompt_param) from None
    finally:
        unfinished = [s.request_id for s in streams if not s.finished]
        if unfinished:
            llm.abort_nowait(unfinished)


async def _final(stream):
    final = None
    async for out in stream:
        final = out
    if final is None or getattr(final, "pooled", None) is None:
        reason = final.outputs[0].error if final is not None and final.outputs else None
        raise OpenAIError(f"the engine ended the request without its pooled output"
                          f"{': ' + reason if reason else ' (aborted)'}", status=500,
                          code="engine_error")
    return final
