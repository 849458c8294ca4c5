"""Turns a user prompt and its SamplingParams into a validated core request.

Every check happens here, before anything is queued, so a bad request never half-enters the engine.
"""
import functools
import numbers
from dataclasses import dataclass

from kiln.config.model_config import ModelConfig, sliding_window_of
from kiln.engine.prompt_length import (
    HEAD_CHARS_PER_TOKEN,
    HEAD_MARGIN_TOKENS,
    clip_max_tokens,
    special_prefix_len,
    too_long_for_head,
    truncate_prompt,
)
from kiln.engine.text_encoding import check_encodable, encode_text
from kiln.inputs import PromptType
from kiln.sampling_params import SamplingParams


@dataclass
class ProcessedPrompt:
    prompt: str | None  # the text, when the user gave text
    prompt_token_ids: list[int]
    params: SamplingParams  # a private copy, resolved against the tokenizer and max_model_len
    # Mixed into the prefix cache's block hashes: only prompts of the same salt share blocks.
    cache_salt: str | None = None
    lora_request: object = None  # kiln.lora.request.LoRARequest, checked; None: the base model


# A dict prompt's keys (vLLM's TextPrompt / TokensPrompt, less what a text-only engine lacks).
PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt", "lora_request")
_MULTIMODAL_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids",
                    "prompt_embeds", "token_type_ids")


def check_prompt_keys(prompt: dict) -> None:
    """Refuse keys Kiln would ignore (a misspelled one, or images for a text-only model)."""
    for key in prompt:
        if key in _MULTIMODAL_KEYS:
            raise ValueError(f"prompt key {key!r} is not supported: Kiln's models are text-only "
                             "(text or token ids)")
        if key not in PROMPT_KEYS:
            raise ValueError(f"unknown prompt key {key!r}; a dict prompt takes "
                             f"{', '.join(PROMPT_KEYS)}")


def bad_words_token_ids(tokenizer, bad_words: list[str],
                        vocab_size: int | None = None) -> list[list[int]]:
    """Each bad word's token ids, as a text's first word and after a space (tokenizers give a
    word different tokens there), each sequence once. A sequence holding an id at or past the
    model's `vocab_size` (a tokenizer with more ids than the model's logits) is left out: the
    model can never write it, and banning its last token indexed past the logits (the engine
    core died)."""
    if tokenizer is None:
        raise ValueError("bad_words needs a tokenizer to find the words' tokens, and this "
                         "engine runs with skip_tokenizer_init=True")
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()  # `ids not in out` scanned the list: 10,000 words took 7 s
    for word in bad_words:
        for text in (word.lstrip(), " " + word.lstrip()):  # vLLM's two forms
            ids = encode_text(tokenizer, text, add_special_tokens=False)
            outside = vocab_size is not None and any(not 0 <= t < vocab_size for t in ids)
            if ids and tuple(ids) not in seen and not outside:
                seen.add(tuple(ids))
                out.append(ids)
    return out


def validate_prompt_token_ids(token_ids: list[int], vocab_size: int, max_model_len: int,
                              longer: str = "raise --max-model-len") -> None:
    """`longer`: what lets a request run longer (longer_context_fix)."""
    if not token_ids:
        raise ValueError("prompt is empty: give at least one token (text or prompt_token_ids; "
                         "empty text is a prompt only for a tokenizer that adds BOS)")
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"prompt length {len(token_ids)} leaves no room to generate within max_model_len "
            f"{max_model_len} (prompt must be shorter than max_model_len); shorten the prompt "
            f"or {longer}")
    for t in token_ids:
        if not isinstance(t, int) or isinstance(t, bool):
            raise ValueError(f"prompt token id {t!r} is a {type(t).__name__}: token ids are "
                             "integers")
        if not 0 <= t < vocab_size:
            raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab_size})")


def prompt_cache_salt(prompt) -> str | None:
    """A prompt's cache_salt: None, or a non-empty string (vLLM refuses an empty one too)."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and not (isinstance(salt, str) and salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
    if salt is not None:
        # Hashed as UTF-8 by the core: a lone surrogate (JSON's "\ud800") failed there, or on
        # the way to it, with an error naming no field (the prompt's, in the server's 400).
        try:
            salt.encode()
        except UnicodeEncodeError:
            raise ValueError(f"cache_salt must be valid Unicode text (no lone surrogates), "
                             f"got {salt!r}") from None
    return salt


def check_logprobs_cap(params, cap: int, vocab_size: int) -> None:
    """The request's logprobs and prompt_logprobs within the engine's max_logprobs; -1 (the
    whole vocabulary, as in vLLM) becomes the vocabulary's size."""
    for name in ("logprobs", "prompt_logprobs"):
        v = getattr(params, name)
        if v == -1:
            v = vocab_size
            setattr(params, name, v)
            if v > cap:
                # The name first: the server reports the field a message opens with.
                raise ValueError(f"{name} is -1, the whole vocabulary ({v}), more than the "
                                 f"engine's max_logprobs {cap}; start it with --max-logprobs -1 "
                                 "to allow that")
        if v is not None and v > vocab_size:
            # A --max-logprobs past the vocabulary lets this through; the sampler's top-k of
            # more tokens than there are killed the engine core. Said first: with a cap of the
            # vocabulary (--max-logprobs -1), "raise --max-logprobs" would send users astray.
            raise ValueError(f"{name} must be <= {vocab_size}, the vocabulary's size (-1 asks "
                             f"for all of it), got {v}")
        if v is not None and v > cap:
            raise ValueError(f"{name} must be <= {cap}, the engine's max_logprobs "
                             f"(--max-logprobs), got {v}")


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer, extra_eos_token_ids=()):
        self.tokenizer = tokenizer
        self.max_model_len = model_config.max_model_len  # the engine may lower it (its KV)
        self.config_max_model_len = model_config.max_model_len
        # Under --disable-sliding-window the model's window caps max_model_len
        window = sliding_window_of(model_config.hf_config, model_config.architecture)
        self.window_cap = window if (model_config.disable_sliding_window
                                     and window == model_config.max_model_len) else None
        self.vocab_size = model_config.vocab_size
        self.max_logprobs = model_config.logprobs_cap
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        # an id past the vocabulary is never sampled (and would fail stop_token_ids' check)
        self.extra_eos_token_ids = {t for t in extra_eos_token_ids if 0 <= t < self.vocab_size}
        # Tokens the whole KV cache holds, once the engine sized it (None: not known yet).
        self.kv_cache_tokens: int | None = None
        # The flags that enlarge it (CacheConfig.larger_cache_flags), set with it.
        self.larger_cache_flags: str | None = None

    @functools.cached_property
    def special_prefix_len(self) -> int:
        return special_prefix_len(self.tokenizer)

    def longer_context_fix(self) -> str:
        """What lets a request run longer: the engine may have capped max_model_len below the
        model's to what its KV cache holds, and then only a larger cache helps."""
        if self.max_model_len < self.config_max_model_len:
            # with --num-gpu-blocks-override set only it enlarges the cache
            grow = self.larger_cache_flags or "--kv-cache-memory (CPU) or --gpu-memory-utilization"
            return (f"raise {grow}: the KV cache capped max_model_len at {self.max_model_len}, "
                    f"below the model's {self.config_max_model_len}")
        if self.window_cap is not None:
            # read after "shorten the prompt or "
            return (f"drop --disable-sliding-window (under it this model's sliding_window="
                    f"{self.window_cap} caps max_model_len)")
        return "raise --max-model-len"

    def tokenize(self, prompt: PromptType, whole: bool = True) -> tuple[str | None, list[int]]:
        """`whole=False`: a text too long for max_model_len may be refused from its head alone
        (the prompt will not be truncated, so its length past that does not matter)."""
        if self.tokenizer is None and (isinstance(prompt, str) or (
                isinstance(prompt, dict) and "prompt_token_ids" not in prompt)):
            raise ValueError("prompt text needs a tokenizer, and this engine runs with "
                             "skip_tokenizer_init=True: give token ids ({'prompt_token_ids': "
                             "[...]}) or start the engine with a tokenizer")
        if isinstance(prompt, str):
            return prompt, self._encode(prompt, whole)
        if isinstance(prompt, dict):
            check_prompt_keys(prompt)
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)):
                    raise ValueError("prompt_token_ids must be a list of integers, got "
                                     f"{type(ids).__name__}")
                if set(map(type, ids)) == {int}:  # checked in C: 600k ids in 14 ms, not 200
                    return prompt.get("prompt"), list(ids)
                # numpy integers (token ids from an array) are ints too
                return prompt.get("prompt"), [int(t) if isinstance(t, numbers.Integral)
                                              and not isinstance(t, bool) else t for t in ids]
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], self._encode(prompt["prompt"], whole)
            raise ValueError("a dict prompt needs 'prompt' (str) or 'prompt_token_ids' (list of "
                             f"int); got keys {sorted(prompt)}")
        hint = (": token ids go in a dict, {'prompt_token_ids': [...]} (a list of ints is "
                "taken as one prompt per int)" if isinstance(prompt, int) else "")
        raise ValueError(f"prompt must be a str or a dict, got {type(prompt).__name__}{hint}")

    def _encode(self, text: str, whole: bool = True) -> list[int]:
        check_encodable(text, "prompt")
        head_chars = HEAD_CHARS_PER_TOKEN * (self.max_model_len + HEAD_MARGIN_TOKENS)
        if not whole and len(text) > head_chars:
            head = encode_text(self.tokenizer, text[:head_chars], add_special_tokens=True)
            if too_long_for_head(len(head), self.max_model_len):
                raise ValueError(
                    f"prompt length is more than {len(head) - HEAD_MARGIN_TOKENS} tokens (its "
                    f"first {head_chars} of {len(text)} characters alone), which leaves no "
                    f"room to generate within max_model_len {self.max_model_len} (prompt must "
                    f"be shorter than max_model_len); shorten the prompt or "
                    f"{self.longer_context_fix()}")
        # add_special_tokens: BOS where the tokenizer adds one (Llama), nothing for Qwen. So ""
        # is [BOS] for Llama (accepted, as in vLLM) and [] for Qwen (refused by validation).
        return encode_text(self.tokenizer, text, add_special_tokens=True)

    def process(self, prompt: PromptType, params: SamplingParams | None, *,
                max_tokens_must_fit: bool = False) -> ProcessedPrompt:
        """`max_tokens_must_fit`: refuse a max_tokens that passes max_model_len (the OpenAI
        server, as vLLM's) instead of cutting it to what fits (LLM.generate)."""
        if params is not None and not isinstance(params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams (or one per prompt), "
                             f"got {type(params).__name__}")
        truncates = getattr(params, "truncate_prompt_tokens", None) is not None
        text, token_ids = self.tokenize(prompt, whole=truncates)
        params = (params or SamplingParams()).clone()
        params.verify()  # fields may have changed since the user built it
        if (params.truncate_prompt_tokens is not None
                and params.truncate_prompt_tokens >= self.max_model_len):
            raise ValueError(f"truncate_prompt_tokens {params.truncate_prompt_tokens} leaves no "
                             f"room to generate within max_model_len {self.max_model_len}: give "
                             f"at most {self.max_model_len - 1}, or -1 (as many as fit)")
        from_text = not (isinstance(prompt, dict) and "prompt_token_ids" in prompt)
        token_ids = truncate_prompt(
            token_ids, params.truncate_prompt_tokens, self.max_model_len,
            self.special_prefix_len if from_text and params.truncate_prompt_tokens else 0)
        validate_prompt_token_ids(token_ids, self.vocab_size, self.max_model_len,
                                  self.longer_context_fix())
        if self.kv_cache_tokens is not None and len(token_ids) > self.kv_cache_tokens:
            raise ValueError(f"prompt length {len(token_ids)} is more than the whole KV cache "
                             f"holds ({self.kv_cache_tokens} tokens); raise "
                             f"{self.larger_cache_flags}, or shorten the prompt")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings are found in the output's text, and this engine "
                             "writes none (skip_tokenizer_init=True); use stop_token_ids")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs the model's tokenizer to compile "
                                 "its grammar; this engine runs with skip_tokenizer_init")
            from kiln.structured_output.xgrammar_backend import check_structured_outputs

            check_structured_outputs(params.structured_outputs)
        check_logprobs_cap(params, self.max_logprobs, self.vocab_size)
        if not params.ignore_eos:
            # As vLLM does: the model's other end tokens (generation_config) are stop tokens,
            # reported as the stop_reason; the tokenizer's eos is not (update_from_tokenizer)
            extra = sorted(self.extra_eos_token_ids - set(params.stop_token_ids)
                           - {self.eos_token_id})
            params.stop_token_ids = [*params.stop_token_ids, *extra]
        params.update_from_tokenizer(self.eos_token_id, self.vocab_size, self.extra_eos_token_ids)
        if params.bad_words:
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words,
                                                             self.vocab_size)
        params.check_masks_leave_a_token()
        clip_max_tokens(params, len(token_ids), self.max_model_len, max_tokens_must_fit)
        salt = prompt_cache_salt(prompt)
        lora = prompt.get("lora_request") if isinstance(prompt, dict) else None
        if lora is not None:  # the engine sets lora_checker (kiln/lora/frontend.py)
            checker = getattr(self, "lora_checker", None)
            if checker is None:
                raise ValueError("lora_request needs an engine started with --enable-lora")
            lora = checker.check(lora)
        return ProcessedPrompt(prompt=text, prompt_token_ids=token_ids, params=params,
                               cache_salt=salt, lora_request=lora)
