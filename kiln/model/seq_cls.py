"""HF's *ForSequenceClassification over a Kiln family: the same backbone, and in place of the LM
head a `score` linear [num_labels, hidden] (no bias) that the pooling runner applies to the
pooled final-norm state (kiln/pooling/runner_pooler.py), as vLLM's as_seq_cls_model.

A *ForCausalLM checkpoint converted by config keys (classifier_from_token, method; vLLM's
Qwen3-Reranker overrides) gets its head from the LM head's rows (kiln/pooling/token_classifier.py).
The head is float32 on every rank (vLLM's head_dtype default for classifiers): it is tiny, and
a bf16 head would round the logits the probabilities come from. It reads the prompt's last
token, as vLLM's; HF's forward skips trailing pad_token_id tokens, so a prompt that ends in the
config's pad id (an eos used as pad) scores another token there.
"""
import functools

import torch

from kiln.errors import ConfigError
from kiln.model.layers.linear import ReplicatedLinear
from kiln.pooling.pooling_task import num_labels


@functools.cache
def for_sequence_classification(causal_cls: type) -> type:
    """The classifier class of a LlamaStyleForCausalLM family class (one per family)."""

    class ForSequenceClassification(causal_cls):
        has_lm_head = False

        def __init__(self, *, kiln_config, prefix: str = ""):
            super().__init__(kiln_config=kiln_config, prefix=prefix)
            self.model_config = kiln_config.model_config  # its tokenizer, for classifier tokens
            self.num_labels = num_labels(self.config)
            previous = torch.get_default_dtype()
            torch.set_default_dtype(torch.float32)
            try:
                self.score = ReplicatedLinear(self.config.hidden_size, self.num_labels,
                                              bias=False)
            finally:
                torch.set_default_dtype(previous)
            self.score.online_quantization = False  # the head stays float32, as the LM head

        def checkpoint_module_name(self, name: str) -> str:
            # a head built from the LM head's rows (tied: the embedding's, which is that head)
            # is stored as the LM head is: what a quantization_config's lm_head entry says
            if name == "score" and getattr(self.config, "method", None) is not None:
                name = "lm_head"
            return super().checkpoint_module_name(name)

        def owns(self, name: str) -> bool:
            return name.startswith("score.") or super().owns(name)

        def load_weights(self, weights):
            # by Kiln's names: GPT-NeoX's LM head is embed_out in its checkpoint
            weights = self.kiln_named(weights)
            method = getattr(self.config, "method", None)
            if method is not None:
                from kiln.pooling.token_classifier import with_score_head
                return super().load_weights(with_score_head(
                    weights, method, self._classifier_token_ids(),
                    bool(getattr(self.config, "tie_word_embeddings", False))))
            # a *ForCausalLM checkpoint converted to a classifier (--convert classify) still
            # holds its LM head: unused, as vLLM drops it
            return super().load_weights((n, t) for n, t in weights
                                        if not n.startswith("lm_head."))

        def _classifier_token_ids(self) -> list[int]:
            from kiln.engine.tokenizer import load_tokenizer
            from kiln.pooling.token_classifier import classifier_token_ids

            config = self.model_config  # the checkpoint's own tokenizer without one loaded
            tokenizer = load_tokenizer(config.tokenizer_path or config.gguf_file
                                       or config.model_path)
            return classifier_token_ids(tokenizer, self.config.classifier_from_token)

        def _check_complete(self, params: dict, loaded: set[str]) -> None:
            if "score.weight" not in loaded:
                raise ConfigError(
                    "checkpoint has no score.weight: a classifier (--convert classify, "
                    "--task classify / score, or a *ForSequenceClassification checkpoint) "
                    "needs its score head; for a *ForCausalLM checkpoint drop --convert / "
                    "--task, or give --convert embed")
            super()._check_complete(params, loaded)

        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("a classification model has no LM head: it runs the pooling "
                               "runner (classify), which calls classify()")

        def classify(self, pooled: torch.Tensor) -> torch.Tensor:
            """`pooled` [N, hidden] -> logits [N, num_labels] float32."""
            return self.score(pooled.float())

    ForSequenceClassification.__name__ = ForSequenceClassification.__qualname__ = \
        causal_cls.__name__.replace("ForCausalLM", "ForSequenceClassification")
    return ForSequenceClassification
