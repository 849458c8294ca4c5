"""Chat inputs before any template runs: messages as vLLM hands them to templates, the render
flags (continue_final_message vs add_generation_prompt), and the empty text prompt."""
import pytest

from kiln.config import ModelConfig
from kiln.engine.chat_messages import chat_messages, chat_render_kwargs
from kiln.engine.input_processor import InputProcessor


def test_text_parts_are_joined_with_newlines_and_null_content_is_empty():
    msgs = chat_messages([
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
         "name": "bob"},
        {"role": "assistant", "content": None},
        {"role": "assistant"},
        {"role": "user", "content": ""},
    ])
    assert msgs == [{"role": "user", "content": "a\nb", "name": "bob"},
                    {"role": "assistant", "content": ""}, {"role": "assistant", "content": ""},
                    {"role": "user", "content": ""}]


def test_refusal_and_responses_api_parts_are_text_as_in_vllm():
    """A conversation replayed from OpenAI holds "refusal" parts in assistant turns; the
    Responses API's parts are "input_text" / "output_text". They were 400s."""
    (msg,) = chat_messages([{"role": "assistant", "content": [
        {"type": "refusal", "refusal": "no"}, {"type": "output_text", "text": "b"},
        {"type": "input_text", "text": "c"}]}])
    assert msg["content"] == "no\nb\nc"


def test_tool_call_arguments_reach_the_template_as_objects_without_touching_the_callers():
    """OpenAI's shape has the arguments as JSON text; templates print them with tojson, so they
    get the object (vLLM's LLM.chat and server both do), for LLM.chat as for the server."""
    calls = [{"id": "c1", "type": "function",
              "function": {"name": "f", "arguments": '{"city": "Paris"}'}},
             {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]
    given = {"role": "assistant", "content": "", "tool_calls": calls}
    (msg,) = chat_messages([given])
    assert [c["function"]["arguments"] for c in msg["tool_calls"]] == [{"city": "Paris"},
                                                                        "not json"]
    assert calls[0]["function"]["arguments"] == '{"city": "Paris"}'  # the caller's, unchanged


@pytest.mark.parametrize("msg, where", [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
     r"messages\[0\]\.content\[0\].*image_url"),
    ({"role": "user", "content": 5}, r"messages\[0\]\.content must be"),
    ({"role": "assistant", "content": [{"type": "refusal", "text": "No."}]},
     r"messages\[0\]\.content\[0\] is a 'refusal' part without its text: give it as "
     r"'refusal'"),
    ({"content": "x"}, r"messages\[0\] must be a dict with a 'role'"),
])
def test_bad_messages_name_the_field(msg, where):
    with pytest.raises(ValueError, match=where):
        chat_messages([msg])


def test_chat_template_kwargs_override_flags_as_in_vllm():
    kw = chat_render_kwargs(True, False, None, {"add_generation_prompt": False,
                                                "enable_thinking": False})
    assert kw == dict(add_generation_prompt=False, continue_final_message=False,
                      chat_template=None, enable_thinking=False)


def test_continue_final_message_needs_add_generation_prompt_off():
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        chat_render_kwargs(True, True, None, None)
    assert chat_render_kwargs(False, True, None, None)["continue_final_message"] is True


def test_renderer_arguments_are_not_template_variables():
    with pytest.raises(ValueError, match=r"chat_template_kwargs may not set \['tokenize'\]"):
        chat_render_kwargs(True, False, None, {"tokenize": True})


@pytest.mark.parametrize("kwargs", ["abc", {1: "x"}, [("a", 1)]])
def test_chat_template_kwargs_must_be_a_dict_of_names(kwargs):
    """LLM.chat's: a str failed as "dictionary update sequence element #0 has length 1", an int
    key in the render as a TypeError, "keywords must be strings"."""
    with pytest.raises(ValueError, match=r"^chat_template_kwargs must be a dict"):
        chat_render_kwargs(True, False, None, kwargs)


def test_empty_text_is_bos_alone_where_the_tokenizer_adds_one(stories_dir, tokenizer):
    """vLLM tokenizes "" and refuses only an empty token list: a Llama tokenizer makes [BOS]."""
    proc = InputProcessor(ModelConfig(model=str(stories_dir), max_model_len=64), tokenizer)
    assert proc.process("", None).prompt_token_ids == [tokenizer.bos_token_id]
    assert proc.process({"prompt": ""}, None).prompt_token_ids == [tokenizer.bos_token_id]


def test_empty_text_is_refused_without_bos(stories_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_dir, add_bos_token=False)
    proc = InputProcessor(ModelConfig(model=str(stories_dir), max_model_len=64), tok)
    assert proc.process("Hi", None).prompt_token_ids == tok("Hi").input_ids  # no BOS
    with pytest.raises(ValueError, match="prompt is empty"):
        proc.process("", None)


def test_bos_text_in_a_prompt_is_a_second_bos_as_in_hf_encode(stories_dir, tokenizer):
    """vLLM encodes with add_special_tokens=True whatever the text holds; so does Kiln."""
    proc = InputProcessor(ModelConfig(model=str(stories_dir), max_model_len=64), tokenizer)
    ids = proc.process("<s>Hello", None).prompt_token_ids
    assert ids == tokenizer("<s>Hello").input_ids and ids[:2] == [1, 1]


def test_an_empty_tool_calls_list_is_no_calls_as_in_vllm():
    """Llama 3.1's template takes `'tool_calls' in message` for a turn that called tools (and
    raises unless there is exactly one): an assistant turn a client sends with [] is plain."""
    (msg,) = chat_messages([{"role": "assistant", "content": "hi", "tool_calls": []}])
    assert msg == {"role": "assistant", "content": "hi"}


def test_vllms_reasoning_field_reaches_templates_as_reasoning_content():
    """vLLM's clients replay an assistant turn's thinking as "reasoning"; templates (Qwen3's)
    read reasoning_content, which vLLM fills from it. It was dropped."""
    (msg,) = chat_messages([{"role": "assistant", "content": "4", "reasoning": "2+2"}])
    assert msg["reasoning_content"] == "2+2"
    (msg,) = chat_messages([{"role": "assistant", "content": "4", "reasoning": "a",
                             "reasoning_content": "b"}])
    assert msg["reasoning_content"] == "b"
