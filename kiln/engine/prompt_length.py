"""How long a prompt and its output may be: max_tokens fit to max_model_len, a prompt's
truncation (truncate_prompt_tokens), and the head of a huge text that already cannot fit.
"""
from kiln.engine.text_encoding import encode_text
from kiln.sampling_params import SamplingParams


def clip_max_tokens(params: SamplingParams, prompt_len: int, max_model_len: int,
                    must_fit: bool = False) -> None:
    """Bound max_tokens so prompt + output fits max_model_len (None: up to max_model_len).
    `must_fit`: refuse a larger max_tokens instead (the OpenAI server, as vLLM's)."""
    room = max_model_len - prompt_len
    if must_fit and params.max_tokens is not None and params.max_tokens > room:
        raise ValueError(f"max_tokens {params.max_tokens} is too large: the prompt's "
                         f"{prompt_len} tokens leave {room} of max_model_len {max_model_len}; "
                         "lower max_tokens or shorten the prompt")
    if must_fit and params.min_tokens > room:
        # max_tokens left out defaults to the room, which min_tokens must not pass (vLLM: 400)
        raise ValueError(f"min_tokens {params.min_tokens} is too large: the prompt's "
                         f"{prompt_len} tokens leave {room} of max_model_len {max_model_len}; "
                         "lower min_tokens or shorten the prompt")
    if params.max_tokens is None or params.max_tokens > room:
        params.max_tokens = room
    params.min_tokens = min(params.min_tokens, params.max_tokens)


def truncate_prompt(token_ids: list[int], truncate_prompt_tokens: int | None,
                    max_model_len: int, head: int = 0) -> list[int]:
    """The prompt's last truncate_prompt_tokens tokens (-1: as many as leave room for one token
    to generate within max_model_len), after its first `head` (a text prompt's special tokens,
    BOS: HF's left truncation, which vLLM's tokenizing does, keeps them)."""
    if truncate_prompt_tokens is None:
        return token_ids
    keep = truncation_length(truncate_prompt_tokens, max_model_len)
    if len(token_ids) <= keep:
        return token_ids
    if 0 < head <= keep:  # keep == head: the special tokens alone, as HF's max_length=1 gives
        return token_ids[:head] + token_ids[len(token_ids) - keep + head:]
    return token_ids[-keep:]


def truncation_length(truncate_prompt_tokens: int, max_model_len: int) -> int:
    """How many tokens truncate_prompt_tokens keeps of a longer prompt."""
    return max_model_len - 1 if truncate_prompt_tokens == -1 else truncate_prompt_tokens


def may_be_truncated(num_prompt_tokens: int, truncate_prompt_tokens: int | None,
                     max_model_len: int) -> bool:
    """Whether the engine's prompt of `num_prompt_tokens` may be a truncated one: a cut prompt
    keeps exactly truncation_length tokens, but one that fit whole may be as long (only its
    text's own tokens tell the two apart)."""
    return (truncate_prompt_tokens is not None
            and num_prompt_tokens == truncation_length(truncate_prompt_tokens, max_model_len))


def special_prefix_len(tokenizer) -> int:
    """How many special tokens (BOS) the tokenizer puts before a text's own tokens."""
    if tokenizer is None:
        return 0
    plain = encode_text(tokenizer, "a", add_special_tokens=False)
    marked = encode_text(tokenizer, "a", add_special_tokens=True)
    return next((k for k in range(len(marked) - len(plain) + 1)
                 if marked[k:k + len(plain)] == plain), 0)


# A text prompt longer than this many characters per max_model_len token is first tokenized
# only up to that length: when that head alone leaves no room, the prompt is refused without
# tokenizing the rest (a 4 MB prompt costs milliseconds, not seconds of a shared CPU).
HEAD_CHARS_PER_TOKEN = 16
# Tokens the head must pass max_model_len by: the cut may split the last words differently.
HEAD_MARGIN_TOKENS = 8


def too_long_for_head(num_head_tokens: int, max_model_len: int) -> bool:
    """Whether a prompt whose first characters gave `num_head_tokens` cannot fit, whatever
    follows (tokens before the cut stay tokens of the whole, all but the last few)."""
    return num_head_tokens >= max_model_len + HEAD_MARGIN_TOKENS
