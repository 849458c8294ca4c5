"""vLLM's "LLM as reranker" conversion: a *ForCausalLM checkpoint served as *ForSequenceClassification
whose score head is built from its LM head's rows for `classifier_from_token` (config keys, usually
given by --hf-overrides), as vLLM's seq_cls_model_loader builds it.

from_2_way_softmax (Qwen3-Reranker's is_original_qwen3_reranker, mxbai-rerank-v2): one label,
row[true] - row[false], so sigmoid(score) = softmax(logit_false, logit_true)[true];
no_post_processing (bge-reranker-v2-gemma): one label per token, the rows as they are.
"""
from collections.abc import Iterable, Iterator

import torch

from kiln.errors import ConfigError

METHODS = ("from_2_way_softmax", "no_post_processing")
_FLAG = "--hf-overrides"


def _values(hf_config) -> dict:
    from kiln.config.hf_config_snapshot import HFConfigSnapshot, snapshot_of

    snapshot = hf_config if isinstance(hf_config, HFConfigSnapshot) else snapshot_of(hf_config)
    return snapshot.to_dict()


def resolve_token_classifier(hf_config):
    """`hf_config` with the conversion its keys ask for resolved, as vLLM's config hooks do:
    is_original_qwen3_reranker sets method from_2_way_softmax, the method sets the label count
    (id2label), and use_sep_token defaults to false (the pair is scored as text_1 + text_2).
    Unchanged where no key asks; ConfigError naming the key where they do not fit."""
    def get(key):
        return getattr(hf_config, key, None)

    tokens, method = get("classifier_from_token"), get("method")
    if get("is_original_qwen3_reranker"):
        if get("model_type") != "qwen3":
            raise ConfigError(f"{_FLAG}: is_original_qwen3_reranker converts a Qwen3 checkpoint "
                              f"(this one's model_type is {get('model_type')!r}); for another "
                              "family give \"method\": \"from_2_way_softmax\" with "
                              "classifier_from_token")
        if method not in (None, "from_2_way_softmax"):
            raise ConfigError(f"{_FLAG}: is_original_qwen3_reranker means method "
                              f"from_2_way_softmax, and method is {method!r}: drop one")
        method = "from_2_way_softmax"
    if method is None:
        if tokens is not None:
            raise ConfigError(f"{_FLAG}: classifier_from_token needs a method: "
                              f"\"method\": one of {', '.join(METHODS)} (or "
                              "\"is_original_qwen3_reranker\": true for Qwen3-Reranker)")
        return hf_config
    if method not in METHODS:
        raise ConfigError(f"{_FLAG}: method {method!r} is not supported; give one of "
                          f"{', '.join(METHODS)}")
    if not (isinstance(tokens, list) and tokens
            and all(isinstance(t, str) and t for t in tokens)):
        raise ConfigError(f"{_FLAG}: method {method} needs classifier_from_token, a list of "
                          f"token strings (e.g. [\"no\", \"yes\"]), got {tokens!r}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ConfigError(f"{_FLAG}: from_2_way_softmax takes two classifier_from_token (the "
                          f"false one, then the true one), got {len(tokens)}")
    labels = 1 if method == "from_2_way_softmax" else len(tokens)
    values = _values(hf_config)
    values.update(method=method, num_labels=labels,
                  id2label={str(i): f"LABEL_{i}" for i in range(labels)},
                  label2id={f"LABEL_{i}": i for i in range(labels)})
    values.setdefault("use_sep_token", False)  # an LLM reranker reads text_1 + text_2
    from kiln.config.hf_config_snapshot import HFConfigSnapshot
    return HFConfigSnapshot(values)


def uses_sep_token(hf_config) -> bool:
    """Whether a cross-encoder scores a pair as the tokenizer's pair encoding (vLLM's
    use_sep_token, default true) or as the one text text_1 + text_2."""
    return bool(getattr(hf_config, "use_sep_token", True))


def classifier_token_ids(tokenizer, tokens: list[str]) -> list[int]:
    """The vocabulary ids of `tokens` (tokens, not texts to encode: "yes", not " yes")."""
    unk = getattr(tokenizer, "unk_token", None)
    ids = []
    for token in tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or (token_id == getattr(tokenizer, "unk_token_id", None)
                                and token != unk):
            raise ConfigError(f"{_FLAG}: classifier_from_token {token!r} is not a token of the "
                              "tokenizer's vocabulary; give the tokens as the vocabulary "
                              "spells them")
        ids.append(int(token_id))
    return ids


def score_weight(rows: torch.Tensor, method: str) -> torch.Tensor:
    """The score head [num_labels, hidden] float32 from the LM head's rows [len(tokens),
    hidden] (classifier_from_token's order)."""
    rows = rows.float()
    if method == "from_2_way_softmax":
        return (rows[1] - rows[0]).unsqueeze(0)
    return rows


def with_score_head(weights: Iterable[tuple[str, torch.Tensor]], method: str,
                    token_ids: list[int], tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors for the classifier: the LM head's (or, tied, the embedding's)
    rows taken for the score head, which follows as score.weight; the LM head dropped."""
    source = "model.embed_tokens.weight" if tied else "lm_head.weight"
    rows = None
    for name, tensor in weights:
        if name == source:
            if tensor.shape[0] <= max(token_ids):
                raise ConfigError(f"classifier_from_token id {max(token_ids)} is past the "
                                  f"checkpoint's {source} ({tensor.shape[0]} rows)")
            rows = tensor[token_ids].clone()
        if name.startswith("lm_head."):
            continue
        yield name, tensor
    if rows is None:
        raise ConfigError(f"method {method} builds the score head from {source}, and the "
                          "checkpoint has none")
    yield "score.weight", score_weight(rows, method)
