"""Pydantic models of the bodies the score, rerank and classify routes send back (vLLM's shapes):
the handlers build them, and /openapi.json states them (openapi_responses.py).
"""
from typing import Literal

from kiln.entrypoints.openai.protocol_base import OpenAIBase


class PoolingUsage(OpenAIBase):
    """vLLM's UsageInfo on a pooling route: every token a prompt token."""
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0
    prompt_tokens_details: None = None


def pooling_usage(num_tokens: int) -> PoolingUsage:
    return PoolingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)


class ScoreData(OpenAIBase):
    index: int  # the pair's place
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIBase):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(OpenAIBase):
    text: str


class RerankResult(OpenAIBase):
    index: int  # the document's place in the request
    document: RerankDocument
    relevance_score: float


class RerankUsage(OpenAIBase):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(OpenAIBase):
    """The documents by score, highest first (top_n of them, where given and above 0)."""
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ClassificationData(OpenAIBase):
    index: int
    label: str | None  # the checkpoint's id2label name of the likeliest class
    probs: list[float]  # per class: probabilities, or logits with use_activation false
    num_classes: int


class ClassificationResponse(OpenAIBase):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage
