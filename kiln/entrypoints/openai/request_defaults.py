"""`RequestDefaults`: what `kiln serve`'s flags give a request that does not say otherwise
(vLLM's --default-chat-template-kwargs, --return-tokens-as-token-ids,
--enable-force-include-usage), applied where each handler reads its request.
"""
import json
from dataclasses import dataclass, field

from kiln.engine.chat_messages import chat_render_kwargs
from kiln.entrypoints.openai.protocol import StreamOptions


@dataclass(frozen=True)
class RequestDefaults:
    # Under each chat's chat_template_kwargs: a request's own keys win (vLLM's merge).
    chat_template_kwargs: dict = field(default_factory=dict)
    # Where a request leaves return_tokens_as_token_ids unset (an explicit false stays false).
    return_tokens_as_token_ids: bool = False
    # Every stream ends with its usage chunk, as if stream_options.include_usage were set.
    force_include_usage: bool = False

    def template_kwargs(self, given: dict | None) -> dict | None:
        if not self.chat_template_kwargs:
            return given
        return {**self.chat_template_kwargs, **(given or {})}

    def apply(self, req) -> None:
        """A completion or chat request, after check_stream_options: the server's defaults
        filled in. continuous_usage_stats still needs asking for, as in vLLM (where a forced
        include_usage makes it count)."""
        if req.return_tokens_as_token_ids is None and self.return_tokens_as_token_ids:
            req.return_tokens_as_token_ids = True
        if self.force_include_usage and req.stream:
            options = req.stream_options or StreamOptions()
            req.stream_options = options.model_copy(update={"include_usage": True})
        if hasattr(req, "chat_template_kwargs"):
            req.chat_template_kwargs = self.template_kwargs(req.chat_template_kwargs)


def parse_default_chat_template_kwargs(text: str | None) -> dict:
    """--default-chat-template-kwargs '{"enable_thinking": false}' -> the dict, checked as a
    request's chat_template_kwargs is, so a bad one fails at start rather than every chat."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--default-chat-template-kwargs is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("--default-chat-template-kwargs takes a JSON object of template "
                         f"variables, e.g. '{{\"enable_thinking\": false}}', got {text!r}")
    if "chat_template" in value:
        raise ValueError("--default-chat-template-kwargs may not set 'chat_template': give "
                         "the template with --chat-template")
    try:
        chat_render_kwargs(True, False, None, value)
    except ValueError as e:
        raise ValueError(f"--default-chat-template-kwargs: {e}") from None
    return value
