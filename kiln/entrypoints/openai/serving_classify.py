"""POST /classify (vLLM's body and response, and its chat form, `messages`) for a classification
model's server: each input's probabilities over the labels (softmax / sigmoid, or the logits
with use_activation false), its predicted label's name from the checkpoint's id2label."""
import time

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
)
from kiln.entrypoints.openai.pooling_responses import (
    ClassificationData,
    ClassificationResponse,
    pooling_usage,
)
from kiln.entrypoints.openai.protocol_base import JsonInt, RequestBase
from kiln.entrypoints.openai.request_fields import response_id
from kiln.entrypoints.openai.serving_engine import ClientDisconnected
from kiln.entrypoints.openai.serving_models import ServingModels
from kiln.pooling.classify_outputs import finish_logits
from kiln.pooling.outputs import PoolingParams
from kiln.pooling.pooling_task import id2label


class ActivationFields(RequestBase):
    """vLLM's use_activation and its older names (one of them may be given)."""
    use_activation: StrictBool | None = None
    activation: StrictBool | None = None
    softmax: StrictBool | None = None

    def pooling_params(self, truncate_prompt_tokens=None) -> PoolingParams:
        """ValueError (a 400 naming the field) where the names disagree."""
        return PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens,
                             use_activation=self.use_activation, activation=self.activation,
                             softmax=self.softmax)


class ClassificationRequest(ActivationFields, PooledInputFields):
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: JsonInt | None = None
    priority: JsonInt = 0
    request_id: str | None = None


def activation_params(req: ActivationFields, truncate_prompt_tokens=None) -> PoolingParams:
    try:
        return req.pooling_params(truncate_prompt_tokens)
    except ValueError as e:
        raise OpenAIError(str(e).removeprefix("PoolingParams: "), param="use_activation",
                          code="invalid_value") from None


class ServingClassification:
    def __init__(self, llm: AsyncLLM, models: ServingModels, chat: ChatSettings | None = None):
        self.llm = llm
        self.models = models
        self.chat = chat or ChatSettings()
        self.task = pooling_task(llm)

    async def create(self, req: ClassificationRequest, raw: Request) -> Response:
        if self.task != "classify":
            raise refuse_task("Classification", self.task, "classify")
        created = int(time.time())
        model = resolve_model(self.models, req.model, raw.url.path)
        params = activation_params(req, req.truncate_prompt_tokens)
        prompts, field = await request_prompts(self.llm, req, self.chat)
        request_id = response_id("classify", req.request_id, raw)
        try:
            finals = await pool(self.llm, raw, request_id, prompts, params, req.priority, field)
        except ClientDisconnected:
            return Response(status_code=499)
        model_config = self.llm.kiln_config.model_config
        labels = id2label(model_config.hf_config)
        data, num_tokens = [], 0
        for i, out in enumerate(finals):
            probs = finish_logits(out.pooled, params, model_config).tolist()
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append(ClassificationData(index=i, label=labels.get(best), probs=probs,
                                           num_classes=len(probs)))
            num_tokens += len(out.prompt_token_ids)
        return JSONResponse(ClassificationResponse(
            id=request_id, created=created, model=model, data=data,
            usage=pooling_usage(num_tokens)).model_dump())
