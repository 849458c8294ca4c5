"""Logit penalties: repetition (HF semantics), presence / frequency (OpenAI), min_tokens masking.

Pure tensor functions over a batch; token tensors are padded with `vocab_size` (ignored).
"""
import torch


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """How often each vocabulary id occurs per row. token_ids: [N, L] padded with vocab_size."""
    n = token_ids.shape[0]
    counts = torch.zeros(n, vocab_size + 1, dtype=torch.int32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.int32))
    return counts[:, :vocab_size]  # [N, V]; the padding column is dropped


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor,
                             penalty: torch.Tensor) -> torch.Tensor:
    """HF semantics: for tokens already in prompt or output, divide positive logits by the
    penalty and multiply negative ones. logits [N, V], seen [N, V] bool, penalty [N]."""
    p = penalty.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, penalised, logits)


def apply_presence_frequency_penalties(logits: torch.Tensor, output_counts: torch.Tensor,
                                       presence: torch.Tensor,
                                       frequency: torch.Tensor) -> torch.Tensor:
    """OpenAI semantics over generated tokens only: subtract frequency * count and presence *
    (count > 0). logits [N, V], output_counts [N, V], presence / frequency [N]."""
    counts = output_counts.to(logits.dtype)
    return (logits - frequency.unsqueeze(1) * counts
            - presence.unsqueeze(1) * (counts > 0).to(logits.dtype))


def apply_all_penalties(logits: torch.Tensor, prompt_token_ids: torch.Tensor,
                        output_token_ids: torch.Tensor, repetition: torch.Tensor,
                        presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    vocab_size = logits.shape[1]
    output_counts = token_counts(output_token_ids, vocab_size)
    seen = (token_counts(prompt_token_ids, vocab_size) > 0) | (output_counts > 0)
    logits = apply_repetition_penalty(logits, seen, repetition)
    return apply_presence_frequency_penalties(logits, output_counts, presence, frequency)


def mask_min_tokens(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Forbid stop / eos tokens for requests still below min_tokens (in place)."""
    logits[rows, cols] = float("-inf")
    return logits
