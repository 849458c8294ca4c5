"""Chat echo (vLLM's): the reply opens with the last message as the template got it."""
import pytest

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
