"""A pooling request's prompts (/v1/embeddings, /classify, /pooling): its `input`, or its chat
`messages` rendered by the chat template as a chat completion's are (vLLM's *ChatRequest)."""
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field, StrictBool

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai.chat_rendering import (
    check_generation_flags,
    render_chat_prompt,
    request_chat_template,
)
from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.protocol import ChatMessage, PromptInput
from kiln.entrypoints.openai.protocol_base import RequestBase
from kiln.entrypoints.openai.request_defaults import RequestDefaults
from kiln.entrypoints.openai.serving_completion import engine_prompts, without_special_tokens
from kiln.entrypoints.openai.serving_engine import check_num_sequences


class PooledInputFields(RequestBase):
    """`input` or vLLM's ChatRequestMixin fields; its defaults: a pooled conversation opens
    no assistant turn (add_generation_prompt false)."""
    input: PromptInput | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool = False
    continue_final_message: StrictBool = False
    chat_template: str | None = None  # Jinja text; needs --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    # null: true for input, false for messages (their template writes them), as in vLLM's
    # completion and chat forms of the request
    add_special_tokens: StrictBool | None = Field(
        None, description="default: true for input, false for messages")


@dataclass(frozen=True)
class ChatSettings:
    """The server's flags that a chat's rendering follows."""
    trust_request_chat_template: bool = False
    defaults: RequestDefaults = field(default_factory=RequestDefaults)


async def request_prompts(llm: AsyncLLM, req: PooledInputFields,
                          chat: ChatSettings) -> tuple[list, str]:
    """(the engine prompts, the field they came from: "input" or "messages")."""
    if (req.input is None) == (req.messages is None):
        given = "both" if req.input is not None else "neither"
        raise OpenAIError(f"give exactly one of input or messages (the body has {given}): "
                          "input for texts or token ids, messages for a chat the template "
                          "renders", param="input", code="invalid_value")
    if req.messages is None:
        prompts = engine_prompts(req.input, "input")
        # the --max-sequences-per-request cap before any text is tokenized (below)
        check_num_sequences(len(prompts), 1, llm.max_sequences_per_request, "input")
        if req.add_special_tokens is False and llm.tokenizer is not None:
            prompts = await without_special_tokens(llm, prompts)
        return prompts, "input"
    check_generation_flags(req)
    prompt = await render_chat_prompt(
        llm, req.messages, req.add_generation_prompt, req.continue_final_message,
        chat.defaults.template_kwargs(req.chat_template_kwargs), bool(req.add_special_tokens),
        chat_template=request_chat_template(req, chat.trust_request_chat_template))
    return [prompt], "messages"
