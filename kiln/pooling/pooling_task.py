"""What a pooling engine computes (vLLM's --convert, its older --task classify / score, and a
*ForSequenceClassification checkpoint's own head), and the classifier's activation.

"embed": the pooled hidden state; "classify": the model's score head (a [num_labels, hidden]
linear) over it, then softmax / sigmoid as vLLM's ClassifierPooler (and for scoring, a
sentence-transformers cross-encoder's own activation_fn).
"""
import torch

from kiln.errors import ConfigError

CONVERTS = ("auto", "none", "embed", "classify")
SEQ_CLS_SUFFIX = "ForSequenceClassification"
# sentence-transformers' cross-encoder activation_fn -> Kiln's kind (vLLM reads torch.nn ones)
_ST_ACTIVATIONS = {"Identity": "identity", "Sigmoid": "classify", "Softmax": "classify",
                   "Tanh": "tanh"}


def is_seq_cls(architecture: str) -> bool:
    return architecture.endswith(SEQ_CLS_SUFFIX)


def check_convert(convert) -> None:
    if convert not in (None, *CONVERTS):
        raise ConfigError(f"--convert {convert!r} is not supported: give auto, none, embed or "
                          "classify (Kiln has no reward or multimodal-encoder conversion)")


def check_runner_fits(architecture: str, runner: str, asked_runner, task) -> None:
    """A sequence-classification checkpoint has no LM head: it cannot generate."""
    if is_seq_cls(architecture) and runner == "generate" and (
            asked_runner == "generate" or task == "generate"):
        raise ConfigError(f"{architecture} is a classification model (a score head, no LM "
                          "head): it runs the pooling runner; drop --runner generate / "
                          "--task generate")


def generate_fix(architecture: str, offline: bool) -> str:
    """What a pooling engine's refusal to generate tells its user: a classification checkpoint
    has no LM head to generate with (no flag helps), any other generates on the generate
    runner (--convert / --task, or a sentence-transformers checkpoint, picked pooling)."""
    if is_seq_cls(architecture):
        return (f"{architecture} is a classification model (a score head, no LM head): "
                "serve a *ForCausalLM checkpoint to generate text")
    if offline:
        return 'build it with runner="generate" (no convert / task) to generate'
    return "start it with --runner generate (no --convert / --task) to generate text"


def pooling_task(convert, task, architecture: str) -> str:
    """"embed" or "classify" for a pooling engine: --convert, else --task, else the
    checkpoint's (a *ForSequenceClassification classifies, a *ForCausalLM embeds)."""
    convert = convert or "auto"
    check_convert(convert)
    asked = task if task in ("embed", "classify") else None
    if convert in ("embed", "classify"):
        if asked is not None and asked != convert:
            raise ConfigError(f"--convert {convert} and --task {task} disagree; give one")
        return convert
    if asked is not None:
        return asked
    if is_seq_cls(architecture):
        return "classify"
    if convert == "none":
        raise ConfigError(f"--convert none: {architecture} has no pooling head of its own; "
                          "give --convert embed (its hidden states) or --convert classify "
                          "(a score.weight head in the checkpoint)")
    return "embed"


def num_labels(hf_config) -> int:
    """HF's num_labels: the id2label map's size (PretrainedConfig's default: 2 labels)."""
    labels = getattr(hf_config, "id2label", None)
    if labels:
        return len(labels)
    return int(getattr(hf_config, "num_labels", None) or 2)


def id2label(hf_config) -> dict[int, str]:
    return {int(k): v for k, v in (getattr(hf_config, "id2label", None) or {}).items()}


def activation_kind(hf_config, api: str) -> str:
    """vLLM's classifier activation for `api` "classify" (HF's problem_type: regression is
    none, multi-label is sigmoid) or "score" (a cross-encoder's sentence-transformers
    activation_fn); "classify": sigmoid for one label, else softmax."""
    if api == "score":
        st = getattr(hf_config, "sentence_transformers", None)
        name = (st or {}).get("activation_fn") if isinstance(st, dict) else None
        name = name or getattr(hf_config, "sbert_ce_default_activation_function", None)
        if name is None:
            return "classify"
        kind = _ST_ACTIVATIONS.get(str(name).rsplit(".", 1)[-1])
        if not str(name).startswith("torch.nn.modules.") or kind is None:
            raise ConfigError(f"the checkpoint's cross-encoder activation_fn {name!r} is not "
                              "supported: Kiln applies torch.nn.modules' Identity, Sigmoid, "
                              "Softmax or Tanh")
        return kind
    problem = getattr(hf_config, "problem_type", None)
    return {"regression": "identity", "multi_label_classification": "sigmoid"}.get(
        problem, "classify")


def activate(logits: torch.Tensor, kind: str) -> torch.Tensor:
    """`logits` [..., num_labels] float32 through the activation `kind` names."""
    if kind == "classify":
        kind = "sigmoid" if logits.shape[-1] < 2 else "softmax"
    if kind == "softmax":
        return torch.softmax(logits, dim=-1)
    if kind == "sigmoid":
        return torch.sigmoid(logits)
    if kind == "tanh":
        return torch.tanh(logits)
    return logits
