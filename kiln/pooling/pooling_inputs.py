"""A pooling request's prompt and parameters checked before it is queued (LLM.embed / encode /
classify / score and the server's pooling routes): the prompt may fill max_model_len (nothing
is generated), `dimensions` only for a model that declares matryoshka embeddings, as vLLM."""
from kiln.engine.input_processor import ProcessedPrompt, validate_prompt_token_ids
from kiln.engine.prompt_length import truncate_prompt
from kiln.pooling.outputs import PoolingParams
from kiln.pooling.pooler_config import matryoshka_dimensions
from kiln.sampling_params import RequestOutputKind, SamplingParams

NOT_POOLING = ("this engine runs the generate runner; start it with --runner pooling (or "
               "--task embed; LLM(model, runner=\"pooling\")) to get embeddings")


# what each API needs of a pooling engine's task (pooling_task.py), and how to get it
_API_TASK = {"embed": ("embed", "an embedding model (--runner pooling on a *ForCausalLM "
                                "checkpoint, or --convert embed)"),
             "classify": ("classify", "a classification model (a *ForSequenceClassification "
                                      "checkpoint, or --convert classify)")}


def check_pooling_engine(engine, api: str | None = None) -> None:
    """`api`: "embed" or "classify" when the caller needs that task (None: any)."""
    model_config = engine.model_config
    if model_config.runner_type != "pooling":
        raise ValueError(NOT_POOLING if api in (None, "embed") else
                         NOT_POOLING.replace("to get embeddings", f"and {_API_TASK[api][1]}"))
    if api in _API_TASK and model_config.pooler_config.task != _API_TASK[api][0]:
        raise ValueError(f"{api} needs {_API_TASK[api][1]}; this engine's pooling task is "
                         f"{model_config.pooler_config.task}")


def check_cross_encoder(model_config) -> None:
    """Scoring with a classifier needs one label: its score (vLLM's num_labels == 1)."""
    from kiln.pooling.pooling_task import num_labels

    labels = num_labels(model_config.hf_config)
    if labels != 1:
        raise ValueError(f"score needs a cross-encoder (a classifier with num_labels 1); this "
                         f"model has {labels} labels: use classify for its probabilities")


def refuse_pooling_bench(model_config, command: str) -> None:
    """A generation benchmark of a pooling engine (its requests end at their prefill with no
    token) said by its flag, not by the benchmark's own "produced 0 output tokens" error."""
    if model_config.runner_type == "pooling":
        raise ValueError(f"{command} measures generation, and this engine runs the pooling "
                         "runner (--runner pooling / --task embed, or a sentence-transformers "
                         "checkpoint), which generates nothing: give --runner generate")


def check_dimensions(dimensions, model_config) -> None:
    if dimensions is None:
        return
    if not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1:
        raise ValueError(f"dimensions must be an integer greater than 0, got {dimensions!r}")
    declared, sizes = matryoshka_dimensions(model_config.hf_config)
    name = model_config.model
    if not declared:
        raise ValueError(f"dimensions: model {name!r} does not support matryoshka "
                         "representation, changing output dimensions will lead to poor "
                         "results (leave dimensions unset)")
    if sizes and dimensions not in sizes:
        raise ValueError(f"dimensions: model {name!r} only supports {list(sizes)} matryoshka "
                         f"dimensions, using other output dimensions will lead to poor results")
    if dimensions > model_config.hidden_size:
        raise ValueError(f"dimensions {dimensions} is more than the model's embedding size "
                         f"{model_config.hidden_size}")


def process_pooling(engine, prompt, params: PoolingParams | None) -> ProcessedPrompt:
    """Tokenize, truncate and validate one pooling prompt (raises ValueError naming the
    field); the engine request it makes is prefill only (max_tokens=1 is never sampled)."""
    check_pooling_engine(engine)
    params = params or PoolingParams()
    if not isinstance(params, PoolingParams):
        raise ValueError(f"pooling_params must be a PoolingParams (or one per prompt), got "
                         f"{type(params).__name__}")
    processor = engine.input_processor
    max_len = processor.max_model_len
    classify = engine.model_config.pooler_config.task == "classify"
    if classify and params.dimensions is not None:
        raise ValueError("dimensions applies to embeddings; this engine classifies (leave "
                         "dimensions unset)")
    check_dimensions(params.dimensions, engine.model_config)
    text, token_ids = processor.tokenize(prompt, whole=True)
    keep = params.truncate_prompt_tokens
    if keep is not None:
        if keep == -1:
            keep = max_len
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1 or keep > max_len:
            raise ValueError(f"truncate_prompt_tokens must be -1 or between 1 and max_model_len "
                             f"{max_len}, got {params.truncate_prompt_tokens!r}")
        # the last tokens, as vLLM keeps them; a text prompt keeps its special tokens (BOS)
        # first, as HF's left truncation (vLLM's tokenizing) and Kiln's generate path do
        from_text = not (isinstance(prompt, dict) and "prompt_token_ids" in prompt)
        token_ids = truncate_prompt(token_ids, keep, max_len,
                                    processor.special_prefix_len if from_text else 0)
    if len(token_ids) > max_len:
        raise ValueError(f"This model's maximum context length is {max_len} tokens. However, "
                         f"you requested {len(token_ids)} tokens in the input for "
                         f"{'classification' if classify else 'embedding generation'}. "
                         "Please reduce the length of the input (or set "
                         "truncate_prompt_tokens).")
    # max_model_len + 1: a prompt may fill the context (nothing is generated after it)
    validate_prompt_token_ids(token_ids, processor.vocab_size, max_len + 1)
    cache = processor.kv_cache_tokens
    if cache is not None and len(token_ids) > cache:
        raise ValueError(f"prompt length {len(token_ids)} is more than the whole KV cache holds "
                         f"({cache} tokens); raise {processor.larger_cache_flags}, or shorten "
                         "the prompt")
    sampling = SamplingParams(max_tokens=1, detokenize=False)
    sampling.output_kind = RequestOutputKind.FINAL_ONLY
    return ProcessedPrompt(prompt=text, prompt_token_ids=list(token_ids), params=sampling)
