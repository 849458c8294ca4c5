"""Rendering a chat request's messages into the engine prompt: the model's (or a trusted
request's) template, tools and documents, and the tail the answer follows (for reasoning).
"""
from kiln.engine.async_llm import AsyncLLM
from kiln.engine.chat_messages import MessageError, chat_messages, chat_render_kwargs
from kiln.engine.text_encoding import encode_text
from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.protocol import ChatMessage


def check_generation_flags(req) -> None:
    """Refuse continue_final_message with an explicit add_generation_prompt=true, as vLLM does
    (the default true yields to continue_final_message)."""
    if (req.continue_final_message and req.add_generation_prompt
            and "add_generation_prompt" in req.model_fields_set):
        raise OpenAIError("continue_final_message and add_generation_prompt cannot both be true: "
                          "one continues the last message, the other opens a new assistant turn",
                          param="continue_final_message", code="invalid_value")


def _plain_messages(messages: list[ChatMessage]) -> list[dict]:
    """The request's messages as the template takes them (on a front-end thread: for thousands
    of messages this is 100 ms and more of Python)."""
    return chat_messages([m.model_dump(exclude_none=True) for m in messages])


async def render_chat_prompt(llm: AsyncLLM, messages: list[ChatMessage],
                             add_generation_prompt: bool, continue_final_message: bool = False,
                             template_kwargs: dict | None = None,
                             add_special_tokens: bool = False,
                             tools: list[dict] | None = None,
                             documents: list[dict] | None = None,
                             chat_template: str | None = None) -> dict:
    """The engine prompt for a conversation: {"prompt": text, "prompt_token_ids": ids}.
    Templates write their own BOS, so no special tokens are added unless asked (vLLM's
    add_special_tokens, default false). `tools` and `documents` go to the template."""
    if documents is not None:  # HF's apply_chat_template hands them to the template; the
        # request's field wins over chat_template_kwargs' "documents" (vLLM's merge)
        template_kwargs = {**(template_kwargs or {}), "documents": documents}
    if not messages:
        raise OpenAIError("messages is empty: give at least one message", param="messages",
                          code="invalid_value")
    if "chat_template" in (template_kwargs or {}):
        raise OpenAIError("chat_template_kwargs may not set 'chat_template': give a template in "
                          "the request's chat_template field", param="chat_template_kwargs",
                          code="invalid_value")
    try:
        plain = await llm.run_in_engine(_plain_messages, messages)
    except MessageError as e:
        raise OpenAIError(str(e), param=e.field, code="unsupported_content") from None
    try:  # the default add_generation_prompt yields to continue_final_message (see above)
        kwargs = chat_render_kwargs(add_generation_prompt and not continue_final_message,
                                    continue_final_message, chat_template, template_kwargs)
    except ValueError as e:
        raise OpenAIError(str(e), param="chat_template_kwargs", code="invalid_value") from None
    if tools is not None:
        kwargs["tools"] = tools
    try:
        prompt = await llm.chat_prompt(plain, **kwargs)
    except Exception as e:  # noqa: BLE001 - jinja errors, sandbox violations, no template
        # The engine's own errors say what failed with the template; "could not render the
        # chat template: ValueError: the chat template does not render: ..." said it twice.
        text = str(e) if isinstance(e, ValueError) and "chat template" in str(e) else \
            f"could not render the chat template: {type(e).__name__}: {e}"
        raise OpenAIError(text, param="messages", code="chat_template_error") from None
    if add_special_tokens:
        prompt["prompt_token_ids"] = await llm.run_in_engine(
            lambda text: encode_text(llm.tokenizer, text, add_special_tokens=True),
            prompt["prompt"])
    return prompt


async def generation_tail(llm: AsyncLLM, render_args: dict, prompt_text: str) -> str:
    """The end of a rendered chat prompt that the answer follows: what the template wrote after
    the earlier turns (the generation prompt; under continue_final_message, the message the
    answer continues). A think tag written in a message, a tool's description or a document is
    not the template opening or closing the thinking: read whole, a user asking about "<think>"
    got an empty answer, all of it taken for reasoning. The whole prompt where the earlier
    turns' own render is not its start (a template that rewrites history)."""
    messages = render_args["messages"]
    earlier = messages[:-1] if render_args["continue_final_message"] else messages
    if not earlier:
        return prompt_text
    before = await render_chat_prompt(llm, **{
        **render_args, "messages": earlier, "add_generation_prompt": False,
        "continue_final_message": False, "add_special_tokens": False})
    start = before["prompt"]
    return prompt_text[len(start):] if prompt_text.startswith(start) else prompt_text


def request_chat_template(req, trusted: bool) -> str | None:
    """The request's own chat template (Jinja text), where the server was started with
    --trust-request-chat-template (vLLM's flag); an empty one means the server's template."""
    if req.chat_template is None:
        return None
    if not trusted:
        # A client's template runs in the server (sandboxed Jinja, but unbounded work), so it
        # is opt-in, as in vLLM.
        raise OpenAIError("chat_template is refused: this server renders chats with its own "
                          "template; start it with --trust-request-chat-template to accept a "
                          "request's, or pass template variables in chat_template_kwargs",
                          param="chat_template", code="unsupported_parameter")
    return req.chat_template or None
