"""vLLM's prompt types (`from vllm.inputs import TokensPrompt, TextPrompt`): the dicts
LLM.generate and LLMEngine.add_request take besides a plain str. Text-only: vLLM's multimodal
and embedding keys are refused by the input processor, with the reason."""
from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]  # prefix-cache blocks are shared only under the same salt


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text the ids came from, echoed as RequestOutput.prompt
    cache_salt: NotRequired[str]


PromptType = str | TextPrompt | TokensPrompt

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]
