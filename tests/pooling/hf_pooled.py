"""The oracles of the pooling tests: HF transformers' AutoModel (no LM head) last_hidden_state,
after the final norm, pooled and normalized as vLLM's pooler does; *ForSequenceClassification's
logits."""
import torch


def hf_pooled(model_dir, prompts, pooling_type: str, normalize: bool) -> list[torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:  # one at a time: no padding in the oracle
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
            vec = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type]
            outs.append(torch.nn.functional.normalize(vec, dim=-1) if normalize else vec)
    return outs


def hf_logits(model_dir, prompts) -> list[torch.Tensor]:
    """HF's *ForSequenceClassification logits [num_labels] of each prompt (ids), one at a time
    (no padding: HF pools the last token, as vLLM)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir,
                                                               dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0] for ids in prompts]
