"""POST /v1/embeddings (OpenAI's body and response, vLLM's extra fields) for a server started with
--runner pooling (or --task embed); what the generate endpoints answer on such a server, and what
/v1/embeddings answers on a generate server.
"""
import asyncio
import base64
import secrets
import time
from typing import Literal

import numpy as np
from fastapi.responses import JSONResponse, Response
from pydantic import StrictBool
from starlette.requests import Request

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.protocol import PromptInput
from kiln.entrypoints.openai.protocol_base import JsonInt, RequestBase
from kiln.entrypoints.openai.request_fields import response_id
from kiln.entrypoints.openai.serving_engine import (
    ClientDisconnected,
    check_num_sequences,
    until_disconnect,
)
from kiln.entrypoints.openai.serving_models import ServingModels
from kiln.pooling.outputs import PoolingParams, finish_vector
from kiln.pooling.pooling_inputs import process_pooling
from kiln.sampling_params import RequestOutputKind, SamplingParams


class EmbeddingRequest(RequestBase):
    model: str | None = None
    input: PromptInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: JsonInt | None = None
    user: str | None = None  # OpenAI's end-user id: taken, changes nothing
    # vLLM's extra fields
    truncate_prompt_tokens: JsonInt | None = None
    add_special_tokens: StrictBool = True
    normalize: StrictBool | None = None  # None: the server's --pooler-config
    priority: JsonInt = 0
    request_id: str | None = None


def refuse_generate(api: str) -> OpenAIError:
    """vLLM's answer to a generate endpoint on a pooling server (400)."""
    return OpenAIError(f"The model does not support {api} API: this server runs the pooling "
                       "runner (--runner pooling); start it without --runner pooling to "
                       "generate text", code="unsupported_endpoint")


def _engine_prompts(value) -> list:
    if isinstance(value, str):
        return [value]
    if not value:
        raise OpenAIError("input is empty: give a string, a list of strings or token ids",
                          param="input", code="invalid_value")
    if isinstance(value[0], int):
        return [{"prompt_token_ids": list(value)}]
    if isinstance(value[0], list):
        return [{"prompt_token_ids": list(p)} for p in value]
    return list(value)


def _field_error(e: ValueError) -> OpenAIError:
    message = str(e)
    param = next((f for f in ("dimensions", "truncate_prompt_tokens", "priority")
                  if message.startswith(f)), "input")
    code = "context_length_exceeded" if "maximum context length" in message else "invalid_value"
    return OpenAIError(message.replace("prompt", "input", 1) if message.startswith("prompt")
                       else message, param=param, code=code)


def _encode(vector, encoding_format: str):
    if encoding_format == "base64":  # OpenAI's: little-endian float32 bytes
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector.tolist()


class ServingEmbedding:
    def __init__(self, llm: AsyncLLM, models: ServingModels):
        self.llm = llm
        self.models = models
        model_config = llm.kiln_config.model_config
        self.pooling = model_config.runner_type == "pooling"
        self.normalize = model_config.pooler_config.normalize if self.pooling else True

    async def create(self, req: EmbeddingRequest, raw: Request) -> Response:
        if not self.pooling:
            raise OpenAIError("The model does not support Embeddings API: this server runs the "
                              "generate runner; start it with --runner pooling (or --task "
                              "embed) to serve /v1/embeddings", code="unsupported_endpoint")
        created = int(time.time())
        model = self.models.resolve(req.model)
        lora = self.models.lora_request(model)
        if lora is not None:  # as offline embed(): else the base model's vectors, silently
            raise OpenAIError(f"`model` {model!r} is a LoRA adapter; /v1/embeddings does not "
                              "apply LoRA adapters yet: ask for the base model "
                              f"{self.models.default_name!r}",
                              param="model", code="unsupported_parameter")
        prompts = _engine_prompts(req.input)
        if not req.add_special_tokens and self.llm.tokenizer is not None:
            from kiln.entrypoints.openai.serving_completion import without_special_tokens
            prompts = await without_special_tokens(self.llm, prompts)
        check_num_sequences(len(prompts), 1, self.llm.max_sequences_per_request, "input")
        params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize,
                               truncate_prompt_tokens=req.truncate_prompt_tokens)
        request_id = response_id("embd", req.request_id, raw)
        try:
            finals = await until_disconnect(raw, self._run(request_id, prompts, params,
                                                           req.priority))
        except ClientDisconnected:
            return Response(status_code=499)
        data, num_tokens = [], 0
        for i, out in enumerate(finals):
            vector = finish_vector(out.pooled, params, self.normalize)
            data.append({"object": "embedding", "index": i,
                         "embedding": _encode(vector, req.encoding_format)})
            num_tokens += len(out.prompt_token_ids)
        return JSONResponse({"id": request_id, "object": "list", "created": created,
                             "model": model, "data": data,
                             "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens,
                                       "completion_tokens": 0,
                                       "prompt_tokens_details": None}})

    async def _run(self, request_id: str, prompts: list, params: PoolingParams,
                   priority: int) -> list:
        """Every prompt checked before any is queued; the finished outputs, in order."""
        llm = self.llm
        try:
            processed = [await llm.run_in_engine(process_pooling, llm.engine, p, params)
                         for p in prompts]
        except ValueError as e:
            raise _field_error(e) from None
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
            return await asyncio.gather(*(self._final(s) for s in streams))
        except ValueError as e:
            raise _field_error(e) from None
        finally:
            unfinished = [s.request_id for s in streams if not s.finished]
            if unfinished:
                llm.abort_nowait(unfinished)

    @staticmethod
    async def _final(stream):
        final = None
        async for out in stream:
            final = out
        if final is None or getattr(final, "pooled", None) is None:
            reason = final.outputs[0].error if final is not None and final.outputs else None
            raise OpenAIError(f"the engine ended the request without an embedding"
                              f"{': ' + reason if reason else ' (aborted)'}", status=500,
                              code="engine_error")
        return final
