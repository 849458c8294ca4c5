"""What the pooling runner's requests return, in vLLM's shapes: `PoolingRequestOutput` (LLM.encode:
`.outputs.data`, a tensor) and `EmbeddingRequestOutput` (LLM.embed: `.outputs.embedding`, a list
of floats), and `PoolingParams`, with what the front end does to a pooled vector (matryoshka
truncation, then L2 normalization), as vLLM's embedding pooler does."""
from dataclasses import dataclass
from typing import Any

import torch

from kiln.outputs import CompletionOutput, RequestOutput


@dataclass
class PoolingParams:
    """vLLM's per-request pooling parameters. `dimensions`: keep the first N (matryoshka models
    only); `normalize`: None takes the engine's --pooler-config; `truncate_prompt_tokens`: keep
    the prompt's last N tokens (-1: max_model_len); `use_activation` (vLLM's older names
    `activation`, `softmax`): a classifier's softmax / sigmoid, None the engine's."""
    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str | None = None  # vLLM's: "embed", "encode", "classify" or "score"
    use_activation: bool | None = None
    activation: bool | None = None
    softmax: bool | None = None

    def __post_init__(self):
        for alias in ("activation", "softmax"):
            value = getattr(self, alias)
            if value is None:
                continue
            if self.use_activation is not None and self.use_activation != value:
                raise ValueError(f"PoolingParams: {alias}={value} and use_activation="
                                 f"{self.use_activation} disagree; give use_activation alone")
            self.use_activation = value
            setattr(self, alias, None)

    def clone(self) -> "PoolingParams":
        return PoolingParams(self.dimensions, self.normalize, self.truncate_prompt_tokens,
                             self.task, self.use_activation)


@dataclass
class PoolingOutput:
    data: torch.Tensor

    def __eq__(self, other) -> bool:
        return isinstance(other, PoolingOutput) and bool(torch.equal(self.data, other.data))


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: Any  # PoolingOutput; EmbeddingOutput in an EmbeddingRequestOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0

    @property
    def prompt(self) -> None:
        return None


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    @classmethod
    def from_base(cls, request_output: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        data = request_output.outputs.data
        return cls(request_id=request_output.request_id,
                   outputs=EmbeddingOutput(data.tolist()),
                   prompt_token_ids=request_output.prompt_token_ids,
                   finished=request_output.finished,
                   num_cached_tokens=request_output.num_cached_tokens)


@dataclass
class PooledRequestOutput(RequestOutput):
    """What the engine (LLMEngine.step, AsyncLLM's streams) gives for a finished pooling
    request: a RequestOutput whose one sample ended with no token ("stop"), so streams and
    metrics take it as any other, and `pooled`, the runner's vector (float32, not
    normalized: LLM.embed and /v1/embeddings finish it per request)."""
    pooled: list[float] | None = None


def pooled_request_output(request_id: str, pooled: list[float], prompt_token_ids: list[int],
                          num_cached_tokens: int, metrics) -> PooledRequestOutput:
    return PooledRequestOutput(
        request_id=request_id, prompt=None, prompt_token_ids=list(prompt_token_ids),
        outputs=[CompletionOutput(0, "", [], finish_reason="stop")], finished=True,
        num_cached_tokens=num_cached_tokens, metrics=metrics, pooled=list(pooled))


def finish_vector(pooled: list[float], params: PoolingParams | None,
                  default_normalize: bool) -> torch.Tensor:
    """The engine's pooled vector as the request asked for it: its first `dimensions`
    entries, then L2-normalized unless normalize is off (float32)."""
    vector = torch.tensor(pooled, dtype=torch.float32)
    if params is not None and params.dimensions is not None:
        vector = vector[:params.dimensions]
    normalize = default_normalize if params is None or params.normalize is None \
        else params.normalize
    if normalize:
        vector = torch.nn.functional.normalize(vector, p=2, dim=-1)
    return vector
