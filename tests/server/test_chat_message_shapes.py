"""Chat message shapes the server takes as vLLM does, and chat echo (vLLM's): the reply opens
with the last message as the template got it."""
import pytest

from kiln.entrypoints.openai.chat_rendering import _plain_messages
from kiln.entrypoints.openai.protocol import ChatCompletionRequest
from kiln.entrypoints.openai.request_fields import echo_prefix


def request(content, **fields):
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"},
                                           {"role": "assistant", "content": content}],
                                 echo=True, continue_final_message=True, **fields)


@pytest.mark.parametrize("content, echoed", [
    ("Hello", "Hello"),
    (None, ""),
    ([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "a\nb"),
    # every text part the template renders: "text" alone was echoed, "a" for "a\nb"
    ([{"type": "text", "text": "a"}, {"type": "output_text", "text": "b"},
      {"type": "refusal", "refusal": "c"}], "a\nb\nc"),
])
def test_echo_is_the_last_message_as_rendered(content, echoed):
    assert echo_prefix(request(content), request(content).messages) == echoed


def test_no_echo_where_the_reply_opens_a_new_turn():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], echo=True)
    assert echo_prefix(req, req.messages) == ""


def test_plain_strings_among_content_parts_are_text_as_in_vllm():
    """vLLM's parser and LLM.chat take a str part as text; the server refused it (a 400 saying
    content should be a string)."""
    req = ChatCompletionRequest(messages=[{"role": "user", "content": [
        "a", {"type": "text", "text": "b"}]}], echo=True, add_generation_prompt=False)
    assert _plain_messages(req.messages) == [{"role": "user", "content": "a\nb"}]
    assert echo_prefix(req, req.messages) == "a\nb"


def test_reasoning_in_an_assistant_turn_is_kept_for_the_template():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}, {
        "role": "assistant", "content": "4", "reasoning": "2+2"}, {"role": "user", "content": "?"}])
    assert _plain_messages(req.messages)[1]["reasoning_content"] == "2+2"
