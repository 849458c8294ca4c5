"""POST /v1/embeddings (OpenAI's body and response, vLLM's extra fields and its chat form,
`messages`) for a server started with --runner pooling (or --task embed), and vLLM's /pooling
(any pooling task's raw output); what the generate endpoints answer on a pooling server.
"""
import base64
import time
from typing import Literal

import numpy as np
from fastapi.responses import JSONResponse, Response
from pydantic import StrictBool
from starlette.requests import Request

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.pooling_prompts import ChatSettings, PooledInputFields, request_prompts
from kiln.entrypoints.openai.pooling_requests import (
    pool,
    pooling_task,
    refuse_task,
    resolve_model,
    usage,
)
from kiln.entrypoints.openai.protocol_base import JsonInt
from kiln.entrypoints.openai.request_fields import response_id
from kiln.entrypoints.openai.serving_engine import ClientDisconnected
from kiln.entrypoints.openai.serving_models import ServingModels
from kiln.pooling.classify_outputs import finish_pooled
from kiln.pooling.outputs import PoolingParams
from kiln.pooling.pooling_task import generate_fix


class EmbeddingRequest(PooledInputFields):
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: JsonInt | None = None
    user: str | None = None  # OpenAI's end-user id: taken, changes nothing
    # vLLM's extra fields
    truncate_prompt_tokens: JsonInt | None = None
    normalize: StrictBool | None = None  # None: the server's --pooler-config
    priority: JsonInt = 0
    request_id: str | None = None


def refuse_generate(api: str, architecture: str) -> OpenAIError:
    """vLLM's answer to a generate endpoint on a pooling server (400)."""
    return OpenAIError(f"The model does not support {api} API: this server runs the pooling "
                       f"runner; {generate_fix(architecture, offline=False)}",
                       code="unsupported_endpoint")


def _encode(vector, encoding_format: str):
    if encoding_format == "base64":  # OpenAI's: little-endian float32 bytes
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector.tolist()


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: the engine's pooled output as its task makes it (an embedding, or a
    classifier's probabilities)."""
    use_activation: StrictBool | None = None
    task: str | None = None  # vLLM's: the pooling task asked for; the server's, or refused


class ServingEmbedding:
    def __init__(self, llm: AsyncLLM, models: ServingModels, chat: ChatSettings | None = None):
        self.llm = llm
        self.models = models
        self.chat = chat or ChatSettings()
        self.task = pooling_task(llm)
        self.pooling = self.task is not None

    async def create(self, req: EmbeddingRequest, raw: Request) -> Response:
        if self.task != "embed":
            raise refuse_task("Embeddings", self.task, "embed")
        return await self._respond(req, raw, "embd", "embedding", "embedding")

    async def pooling_create(self, req: PoolingRequest, raw: Request) -> Response:
        if self.task is None:
            raise refuse_task("Pooling", None, "embed")
        if req.task is not None and req.task != self.task:  # not another task's output, silently
            raise OpenAIError(f"task {req.task!r} is not supported: this server runs the pooling "
                              f"runner's {self.task} task; give task {self.task!r} or leave it "
                              "out", param="task", code="unsupported_parameter")
        return await self._respond(req, raw, "pool", "pooling", "data")

    async def _respond(self, req, raw: Request, prefix: str, kind: str, key: str) -> Response:
        created = int(time.time())
        model = resolve_model(self.models, req.model, raw.url.path)
        prompts, field = await request_prompts(self.llm, req, self.chat)
        params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize,
                               truncate_prompt_tokens=req.truncate_prompt_tokens,
                               use_activation=getattr(req, "use_activation", None))
        request_id = response_id(prefix, req.request_id, raw)
        try:
            finals = await pool(self.llm, raw, request_id, prompts, params, req.priority, field)
        except ClientDisconnected:
            return Response(status_code=499)
        model_config = self.llm.kiln_config.model_config
        data, num_tokens = [], 0
        for i, out in enumerate(finals):
            vector = finish_pooled(out.pooled, params, model_config)
            data.append({"object": kind, "index": i, key: _encode(vector, req.encoding_format)})
            num_tokens += len(out.prompt_token_ids)
        return JSONResponse({"id": request_id, "object": "list", "created": created,
                             "model": model, "data": data, "usage": usage(num_tokens)})
