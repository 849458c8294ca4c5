"""LLM.embed / encode / classify (vLLM's offline pooling API) for an engine built with
runner="pooling": every prompt is checked before any is queued, outputs come back in input
order (LLM.score: scoring.py)."""
from collections.abc import Sequence

from kiln.pooling.classify_outputs import ClassificationRequestOutput, finish_pooled
from kiln.pooling.outputs import (
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingParams,
    PoolingRequestOutput,
)
from kiln.pooling.pooling_inputs import check_pooling_engine, process_pooling


def _params_list(pooling_params, n: int, truncate_prompt_tokens) -> list[PoolingParams]:
    if pooling_params is None or isinstance(pooling_params, PoolingParams):
        params = [(pooling_params or PoolingParams()).clone() for _ in range(n)]
    elif isinstance(pooling_params, (list, tuple)):
        if len(pooling_params) != n:
            raise ValueError(f"got {len(pooling_params)} pooling_params for {n} prompts; pass "
                             "one PoolingParams or one per prompt")
        params = [(p or PoolingParams()).clone() if isinstance(p, (PoolingParams, type(None)))
                  else p for p in pooling_params]
    else:
        raise ValueError("pooling_params must be a PoolingParams or a list of them, got "
                         f"{type(pooling_params).__name__}")
    if truncate_prompt_tokens is not None:
        for p in params:
            if isinstance(p, PoolingParams):
                p.truncate_prompt_tokens = truncate_prompt_tokens
    return params


def engine_outputs(llm, prompts: list, params: list, use_tqdm) -> list:
    """The engine's outputs (PooledRequestOutput: the raw pooled vector) of every prompt, in
    order; each prompt is checked before any is queued."""
    engine = llm.llm_engine
    processed = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        try:
            processed.append(process_pooling(engine, prompt, p))
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
    return llm._run(processed, use_tqdm)


def as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, Sequence):
        raise ValueError("prompts must be a str, a {'prompt_token_ids': [...]} dict or a list "
                         f"of them, got {type(prompts).__name__}")
    return list(prompts)


def run_pooling(llm, prompts, pooling_params, truncate_prompt_tokens, use_tqdm,
                lora_request, api: str | None = None,
                method: str = "embed() or encode") -> list[PoolingRequestOutput]:
    """Pool every prompt; each output's data is what its PoolingParams asked for: an embedding
    (dimensions, normalize; the engine's --pooler-config normalize by default) or a
    classifier's probabilities (use_activation). `api`: the task the caller needs."""
    from kiln.entrypoints.llm_arguments import refuse_lora

    refuse_lora(lora_request, method)
    engine = llm.llm_engine
    check_pooling_engine(engine, api)
    prompts = as_prompt_list(prompts)
    params = _params_list(pooling_params, len(prompts), truncate_prompt_tokens)
    outputs = engine_outputs(llm, prompts, params, use_tqdm)
    model_config = engine.model_config
    return [PoolingRequestOutput(out.request_id,
                                 PoolingOutput(finish_pooled(out.pooled, p, model_config)),
                                 out.prompt_token_ids, out.finished, out.num_cached_tokens)
            for out, p in zip(outputs, params)]


def embed(llm, prompts, truncate_prompt_tokens=None, use_tqdm=True,
          pooling_params=None, lora_request=None) -> list[EmbeddingRequestOutput]:
    return [EmbeddingRequestOutput.from_base(out) for out in
            run_pooling(llm, prompts, pooling_params, truncate_prompt_tokens, use_tqdm,
                        lora_request, api="embed")]


def classify(llm, prompts, truncate_prompt_tokens=None, use_tqdm=True, pooling_params=None,
             lora_request=None) -> list[ClassificationRequestOutput]:
    return [ClassificationRequestOutput.from_base(out) for out in
            run_pooling(llm, prompts, pooling_params, truncate_prompt_tokens, use_tqdm,
                        lora_request, api="classify", method="classify")]
