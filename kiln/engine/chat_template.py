"""Rendering a conversation with a chat template (HF's sandboxed Jinja), every failure of the
template's own making told as the template's, so the API answers 400 and `kiln chat` one line."""

# Errors only a template's own code raises while rendering (jinja's TemplateError is added
# where jinja is imported); a ValueError is blamed on the template only from inside it.
_TEMPLATE_FAULTS: tuple[type[BaseException], ...] = (
    ArithmeticError, LookupError, TypeError, AttributeError, RecursionError)


def raised_in_template(e: BaseException) -> bool:
    """Whether `e` came out of a jinja template's own code: jinja names the frames of the code
    it compiled from a template string '<template>'."""
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            return True
        tb = tb.tb_next
    return False


def require_chat_template(tokenizer, chat_template: str | None, model: str) -> None:
    """A ValueError naming the model and the flag when there is no template to render with
    (`chat_template` None: the tokenizer's own)."""
    from kiln.model.loader.default_model import model_display_name

    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer of {model_display_name(model)!r} has no chat template; "
                         "pass one (chat_template=, --chat-template) or use a chat model")


def render_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool,
                         chat_template: str | None, model: str, **kwargs) -> str:
    """The conversation as text; `chat_template` None: the tokenizer's own. `model` names the
    checkpoint where it has no template."""
    from jinja2 import TemplateError

    if tokenizer is None:
        raise ValueError("chat needs a tokenizer to render and tokenize the conversation; "
                         "this engine runs with skip_tokenizer_init=True")
    require_chat_template(tokenizer, chat_template, model)
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m):
            raise ValueError(f"messages[{i}] must be a dict with 'role' (str) and 'content', "
                             f"got {m!r}")
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            chat_template=chat_template, **kwargs)
    except Exception as e:  # noqa: BLE001 - whatever the template's own code raised
        # A broken template, one that raise_exception()s, or one failing in its own code
        # ({{ 1/0 }}, "abc".index("z"), truncate(-1)'s assert): kiln chat died with a
        # traceback, or said "substring not found" naming nothing. HF's own checks
        # (continue_final_message, tools) are ValueErrors from outside it, which name the fix.
        if not isinstance(e, (TemplateError, *_TEMPLATE_FAULTS)) and not raised_in_template(e):
            raise
        raise ValueError(f"the chat template does not render: {type(e).__name__}: {e}") \
            from None
