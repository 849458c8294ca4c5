"""Chat messages as chat templates take them, as vLLM hands them over (text parts joined, tool-call
arguments as objects), and the arguments a chat is rendered with; bad messages name their field."""
import json

from kiln.engine.text_encoding import encoding_problem

# Keys apply_chat_template owns: a template variable by these names would break the render call.
_RESERVED_TEMPLATE_KWARGS = ("tokenize", "conversation", "messages", "return_dict",
                             "tokenizer_kwargs")


class MessageError(ValueError):
    """A chat message a template cannot take; `field` names it (messages[i].content[j])."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field} {problem}")
        self.field = field


def _arguments_as_objects(calls: list) -> list:
    """Assistant turns' tool-call arguments arrive as JSON text (OpenAI's shape); templates
    print them with tojson, so they get the object, as vLLM hands them over. A copy: the
    caller's messages stay as they were."""
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                call = {**call, "function": {**function,
                                             "arguments": json.loads(function["arguments"])}}
            except ValueError:
                pass  # not JSON: the template gets the text as it came
        out.append(call)
    return out


# Content parts that are text, and the key that holds it: OpenAI's assistant history carries
# "refusal" parts, the Responses API "input_text" / "output_text" (vLLM reads all four as text).
_TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text",
                   "refusal": "refusal"}


def chat_messages(messages: list) -> list[dict]:
    """Messages as chat templates expect them, as vLLM hands them over: text content parts
    joined with newlines, missing or null content as "", tool-call arguments as objects,
    other keys (name, ...) kept."""
    out = []
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
            raise MessageError(f"messages[{i}]", f"must be a dict with a 'role' (str) and "
                               f"'content', got {m!r}")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, (list, tuple)):
            texts = []
            for j, part in enumerate(content):
                if isinstance(part, str):
                    texts.append(part)
                elif (isinstance(part, dict) and part.get("type") in _TEXT_PART_KEYS
                      and isinstance(part.get(_TEXT_PART_KEYS[part["type"]]), str)):
                    texts.append(part[_TEXT_PART_KEYS[part["type"]]])
                elif isinstance(part, dict) and part.get("type") in _TEXT_PART_KEYS:
                    key = _TEXT_PART_KEYS[part["type"]]
                    raise MessageError(f"messages[{i}].content[{j}]", f"is a {part['type']!r} "
                                       f"part without its text: give it as {key!r} (a string)")
                else:
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise MessageError(f"messages[{i}].content[{j}]", f"is a content part of type "
                                       f"{kind!r}, not supported; give {{'type': 'text', 'text': "
                                       "...} parts")
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise MessageError(f"messages[{i}].content", "must be a str or a list of text parts, "
                               f"got {type(content).__name__}")
        problem = encoding_problem(content)
        if problem is not None:
            raise MessageError(f"messages[{i}].content", problem)
        message = {**m, "content": content}
        if isinstance(m.get("reasoning"), str) and m.get("reasoning_content") is None:
            # vLLM's current name for an assistant turn's thinking; templates read
            # reasoning_content (Qwen3's), which vLLM sets from it too
            message["reasoning_content"] = m["reasoning"]
        if m.get("tool_calls") == []:
            # No calls, as vLLM drops it: templates testing `'tool_calls' in message` (Llama
            # 3.1's) took the turn for a call and raised, for clients that send [] for none.
            del message["tool_calls"]
        elif isinstance(m.get("tool_calls"), list):
            message["tool_calls"] = _arguments_as_objects(m["tool_calls"])
        out.append(message)
    return out


def chat_render_kwargs(add_generation_prompt: bool, continue_final_message: bool,
                       chat_template: str | None, chat_template_kwargs: dict | None) -> dict:
    """The arguments for rendering a chat; chat_template_kwargs override the named flags, as
    in vLLM's LLM.chat. Both flags on is refused, as HF and vLLM refuse it."""
    kwargs = dict(add_generation_prompt=add_generation_prompt,
                  continue_final_message=continue_final_message, chat_template=chat_template)
    if chat_template_kwargs is not None and not (
            isinstance(chat_template_kwargs, dict)
            and all(isinstance(k, str) for k in chat_template_kwargs)):
        # they become the template's variables: a str failed in dict() ("dictionary update
        # sequence element #0..."), an int key in the render ("keywords must be strings")
        raise ValueError("chat_template_kwargs must be a dict of template variable names "
                         f"(str) to values, got {chat_template_kwargs!r:.200}")
    extra = dict(chat_template_kwargs or {})
    reserved = sorted(k for k in extra if k in _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved}: these belong to the "
                         "renderer, not the template")
    kwargs.update(extra)
    if kwargs["continue_final_message"] and kwargs["add_generation_prompt"]:
        raise ValueError("continue_final_message=True continues the last message, "
                         "add_generation_prompt=True starts a new assistant turn: they cannot "
                         "both be set; pass add_generation_prompt=False")
    return kwargs
