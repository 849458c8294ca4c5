"""What a classify engine's requests return, in vLLM's shapes: `ClassificationRequestOutput`
(LLM.classify: `.outputs.probs`) and `ScoringRequestOutput` (LLM.score: `.outputs.score`), and
what the front end does to the score head's logits (the activation a request asks for)."""
from dataclasses import dataclass

import torch

from kiln.pooling.outputs import (
    PoolingOutput,
    PoolingParams,
    PoolingRequestOutput,
    finish_vector,
)
from kiln.pooling.pooling_task import activate, activation_kind


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)

    @classmethod
    def from_base(cls, output: PoolingOutput) -> "ClassificationOutput":
        if output.data.ndim != 1:
            raise ValueError(f"classification data must be 1-D, got shape "
                             f"{tuple(output.data.shape)}")
        return cls(output.data.tolist())


@dataclass
class ScoringOutput:
    score: float

    @classmethod
    def from_base(cls, output: PoolingOutput) -> "ScoringOutput":
        data = output.data.squeeze()
        if data.ndim != 0:
            raise ValueError("a score is one number: scoring needs a model with one label "
                             f"(got {data.numel()} values)")
        return cls(float(data.item()))


def _derived(cls, out: PoolingRequestOutput, outputs):
    return cls(request_id=out.request_id, outputs=outputs,
               prompt_token_ids=out.prompt_token_ids, finished=out.finished,
               num_cached_tokens=out.num_cached_tokens)


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "ClassificationRequestOutput":
        return _derived(cls, out, ClassificationOutput.from_base(out.outputs))


@dataclass
class ScoringRequestOutput(PoolingRequestOutput):
    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "ScoringRequestOutput":
        return _derived(cls, out, ScoringOutput.from_base(out.outputs))


def finish_logits(pooled: list[float], params: PoolingParams | None, model_config,
                  api: str = "classify") -> torch.Tensor:
    """A classify engine's logits [num_labels] as the request asked: through the activation
    of `api` ("classify" or "score") unless use_activation is off (float32)."""
    logits = torch.tensor(pooled, dtype=torch.float32)
    use = params.use_activation if params is not None else None
    if use is None:
        use = model_config.pooler_config.use_activation
    return activate(logits, activation_kind(model_config.hf_config, api)) if use else logits


def finish_pooled(pooled: list[float], params: PoolingParams | None, model_config,
                  api: str | None = None) -> torch.Tensor:
    """The engine's pooled output as its task makes it: an embedding (normalized per params)
    or a classifier's activated logits."""
    pooler = model_config.pooler_config
    if pooler.task == "classify":
        return finish_logits(pooled, params, model_config, api or "classify")
    return finish_vector(pooled, params, pooler.normalize)
