"""vLLM's scoring (LLM.score, /score, /rerank): a cross-encoder (a classify engine whose model has
one label) scores each (text_1, text_2) pair by its activated logit, the pair tokenized as the
tokenizer's pair encoding, as text_1 + text_2 (an LLM reranker: use_sep_token false), or as an
explicit chat template renders the query and document roles (--chat-template, chat_template=);
an embedding engine scores the cosine similarity of the two embeddings.

Inputs pair 1:1, 1:N (the one text_1 against each text_2) or N:N, as vLLM's."""
import torch

from kiln.engine.text_encoding import check_encodable
from kiln.pooling.classify_outputs import ScoringRequestOutput, finish_logits
from kiln.pooling.outputs import PoolingOutput, PoolingParams, PoolingRequestOutput, finish_vector
from kiln.pooling.pooling_inputs import check_cross_encoder, check_pooling_engine
from kiln.pooling.token_classifier import uses_sep_token


def score_lists(data_1, data_2, names=("text_1", "text_2")) -> tuple[list, list]:
    """Both sides as lists that pair (1:1, 1:N or N:N); ValueError names the side when they
    do not."""
    one, two = _side(data_1, names[0]), _side(data_2, names[1])
    if not one:
        raise ValueError(f"{names[0]} is empty: give at least one text")
    if not two:
        raise ValueError(f"{names[1]} is empty: give at least one text")
    if len(one) > 1 and len(one) != len(two):
        raise ValueError(f"{names[0]} has {len(one)} texts and {names[1]} {len(two)}: input "
                         "lengths must be either 1:1, 1:N or N:N")
    return one, two


def _side(data, name: str) -> list:
    if isinstance(data, (str, dict)):
        return [data]
    if not isinstance(data, (list, tuple)):
        raise ValueError(f"{name} must be a text or a list of texts, got "
                         f"{type(data).__name__}")
    return list(data)


def is_cross_encoder(model_config) -> bool:
    return model_config.pooler_config.task == "classify"


def pair_text(engine, text_1: str, text_2: str, chat_template: str | None) -> str | None:
    """The one text a pair is scored as: an explicit chat template's render of the query and
    the document (vLLM applies none by default: base models' templates are no score
    templates), text_1 + text_2 where the model has no separator (use_sep_token false), or
    None for the tokenizer's pair encoding."""
    if chat_template is not None:
        return engine.apply_chat_template([{"role": "query", "content": text_1},
                                           {"role": "document", "content": text_2}],
                                          add_generation_prompt=False,
                                          chat_template=chat_template)
    if not uses_sep_token(engine.model_config.hf_config):
        return text_1 + text_2
    return None


def pair_token_ids(tokenizer, text_1, text_2, truncate_prompt_tokens, max_model_len,
                   names=("text_1", "text_2"), engine=None,
                   chat_template: str | None = None) -> list[int]:
    """The pair as one prompt: the tokenizer's pair encoding (its separators, vLLM's
    use_sep_token default) or pair_text's; truncate_prompt_tokens cuts it in the tokenizer
    (longest first), as vLLM passes truncation to it."""
    if tokenizer is None:
        raise ValueError("scoring a text pair needs a tokenizer; this engine runs with "
                         "skip_tokenizer_init=True")
    for text, name in zip((text_1, text_2), names):
        if not isinstance(text, str):
            raise ValueError(f"{name}: a cross-encoder scores texts, got "
                             f"{type(text).__name__}")
        check_encodable(text, name)
    joined = pair_text(engine, text_1, text_2, chat_template) if engine is not None else None
    kwargs = {}
    keep = truncate_prompt_tokens
    if keep is not None:
        keep = max_model_len if keep == -1 else keep
        if not isinstance(keep, int) or isinstance(keep, bool) or not 1 <= keep <= max_model_len:
            raise ValueError(f"truncate_prompt_tokens must be -1 or between 1 and "
                             f"max_model_len {max_model_len}, got {truncate_prompt_tokens!r}")
        kwargs = dict(truncation=True, max_length=keep)
    try:
        pair = dict(text=joined) if joined is not None else dict(text=text_1, text_pair=text_2)
        ids = tokenizer(**pair, add_special_tokens=True, **kwargs)["input_ids"]
    except Exception as e:  # noqa: BLE001 - the tokenizer's refusal (a pair it cannot cut)
        raise ValueError(f"truncate_prompt_tokens: the tokenizer cannot encode the pair "
                         f"within {keep} tokens: {e}") from None
    return list(ids)


def cosine_output(one: PoolingRequestOutput, two: PoolingRequestOutput,
                  pad_token_id) -> PoolingRequestOutput:
    """Two embeddings' cosine similarity, with the tokens of both (vLLM's, a pad between)."""
    score = torch.nn.functional.cosine_similarity(one.outputs.data, two.outputs.data, dim=0)
    pad = [pad_token_id] if pad_token_id is not None else []
    return PoolingRequestOutput(f"{one.request_id}_{two.request_id}", PoolingOutput(score),
                                one.prompt_token_ids + pad + two.prompt_token_ids,
                                num_cached_tokens=one.num_cached_tokens + two.num_cached_tokens)


def score_prompts(engine, data_1, data_2, truncate_prompt_tokens,
                  names=("text_1", "text_2"),
                  chat_template: str | None = None) -> tuple[list, int | None, int]:
    """(prompts to pool, their PoolingParams' truncation, the number of pairs) for `engine`'s
    way of scoring: the pairs (a cross-encoder; truncated in the tokenizer; `chat_template`,
    else the engine's --chat-template, renders them where given) or text_1's then text_2's
    texts (an embedding model; a single text_1 is pooled once)."""
    one, two = score_lists(data_1, data_2, names)
    if not is_cross_encoder(engine.model_config):
        return one + two, truncate_prompt_tokens, len(two)
    check_cross_encoder(engine.model_config)
    processor = engine.input_processor
    template = chat_template or engine.model_config.chat_template
    return [{"prompt_token_ids": pair_token_ids(processor.tokenizer, a, b,
                                                truncate_prompt_tokens,
                                                processor.max_model_len, names, engine,
                                                template)}
            for a, b in zip(one * len(two) if len(one) == 1 else one, two)], None, len(two)


def finish_scores(model_config, outputs: list, params: PoolingParams, num_2: int,
                  pad_token_id) -> list[PoolingRequestOutput]:
    """The engine's pooled outputs (score_prompts' order) as one scalar score per pair."""
    if is_cross_encoder(model_config):
        return [PoolingRequestOutput(o.request_id, PoolingOutput(
                    finish_logits(o.pooled, params, model_config, "score")),
                    o.prompt_token_ids, o.finished, o.num_cached_tokens) for o in outputs]
    vectors = [PoolingRequestOutput(o.request_id, PoolingOutput(
                   finish_vector(o.pooled, None, True)), o.prompt_token_ids, o.finished,
                   o.num_cached_tokens) for o in outputs]
    first, second = vectors[:len(vectors) - num_2], vectors[len(vectors) - num_2:]
    first = first * num_2 if len(first) == 1 else first
    return [cosine_output(a, b, pad_token_id) for a, b in zip(first, second)]


def score(llm, data_1, data_2, truncate_prompt_tokens=None, use_tqdm=True,
          pooling_params=None, lora_request=None,
          chat_template: str | None = None) -> list[ScoringRequestOutput]:
    """LLM.score: one ScoringRequestOutput per pair (`.outputs.score`)."""
    from kiln.entrypoints.llm_arguments import refuse_lora
    from kiln.pooling.offline import engine_outputs

    refuse_lora(lora_request, "score")
    engine = llm.llm_engine
    check_pooling_engine(engine)
    if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
        raise ValueError("pooling_params must be one PoolingParams for score(), got "
                         f"{type(pooling_params).__name__}")
    params = (pooling_params or PoolingParams()).clone()
    if truncate_prompt_tokens is None:
        truncate_prompt_tokens = params.truncate_prompt_tokens
    prompts, truncate, num_2 = score_prompts(engine, data_1, data_2, truncate_prompt_tokens,
                                             ("data_1", "data_2"), chat_template)
    each = PoolingParams(truncate_prompt_tokens=truncate)
    outputs = engine_outputs(llm, prompts, [each] * len(prompts), use_tqdm)
    tokenizer = engine.input_processor.tokenizer
    return [ScoringRequestOutput.from_base(o) for o in finish_scores(
        engine.model_config, outputs, params, num_2, getattr(tokenizer, "pad_token_id", None))]
