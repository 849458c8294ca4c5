"""End to end with --reasoning-parser qwen3: the <think> block comes back as reasoning_content,
whole and streamed alike, and a grammar (schemas, forced tool_choice) waits for its end."""
import re

import httpx
import pytest

from .test_server_e2e import KEY, NAME
from .test_structured_server import MESSAGES, TIME, WEATHER, _reassemble, _serve, tiny_qwen_chat

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def reasoning_client(tmp_path_factory):
    model = tiny_qwen_chat(tmp_path_factory)
    with _serve(model, tmp_path_factory, "--reasoning-parser", "qwen3") as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


def test_reasoning_split(reasoning_client):
    """The grammar writes a <think> block: its text comes back as reasoning_content, whole and
    streamed alike. (Thinking is switched off in the template, so the grammar applies from the
    first token rather than after the model's own </think>.)"""
    client = reasoning_client
    pattern = "<think>[a-z]{1,6}( [a-z]{1,6}){0,2}</think>[a-z]{1,6}"
    kw = dict(model=NAME, messages=MESSAGES, max_tokens=60, temperature=0,
              extra_body={"structured_outputs": {"regex": pattern},
                          "chat_template_kwargs": {"enable_thinking": False}})
    r = client.chat.completions.create(**kw)
    m = r.choices[0].message
    raw = f"<think>{m.reasoning_content}</think>{m.content}"
    assert re.fullmatch(pattern, raw), raw
    reasoning = content = ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    assert (reasoning, content) == (m.reasoning_content, m.content)
    # vLLM's newer name for the field (its clients read `reasoning`), whole and streamed
    assert m.model_extra["reasoning"] == m.reasoning_content
    assert "".join(c.delta.model_extra.get("reasoning") or ""
                   for chunk in client.chat.completions.create(stream=True, **kw)
                   for c in chunk.choices) == m.reasoning_content
    # include_reasoning=false: the thinking is dropped, the content stays.
    r = client.chat.completions.create(**{**kw, "extra_body": {
        **kw["extra_body"], "include_reasoning": False}})
    assert r.choices[0].message.reasoning_content is None
    assert r.choices[0].message.content == m.content
    # A constrained answer with the thinking closed in the prompt is all content.
    r = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=20, temperature=0,
        extra_body={"structured_outputs": {"regex": "[a-z]{3}"},
                    "chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.reasoning_content is None
    assert re.fullmatch("[a-z]{3}", r.choices[0].message.content)


def test_grammar_waits_for_the_thinking(reasoning_client):
    """With thinking on, the grammar applies after </think>: this random model never writes
    one, so its answer runs free (to max_tokens) instead of being forced into the pattern."""
    r = reasoning_client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=12, temperature=0,
        extra_body={"structured_outputs": {"regex": "z{1,3}"}})
    assert r.choices[0].finish_reason == "length"
    m = r.choices[0].message
    assert not re.fullmatch("z{1,3}", (m.reasoning_content or "") + (m.content or ""))


@pytest.mark.parametrize("tool_choice", [
    {"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_a_forced_call_that_never_leaves_the_thinking(reasoning_client, tool_choice):
    """Thinking on, a call forced: the grammar waits for </think>, which this random model never
    writes, so all it wrote is thinking and no call began: reasoning_content, no content, no
    tool_calls, finish_reason the engine's, whole and streamed alike (as vLLM's qwen3 parser
    reads an answer that never closes its thinking)."""
    kw = dict(model=NAME, messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=12,
              temperature=0, tool_choice=tool_choice)
    choice = reasoning_client.chat.completions.create(**kw).choices[0]
    m = choice.message
    assert m.reasoning_content and (m.content, m.tool_calls, choice.finish_reason) == (
        None, [], "length"), choice
    chunks = list(reasoning_client.chat.completions.create(stream=True, **kw))
    reasoning = "".join(getattr(c.delta, "reasoning_content", None) or ""
                        for chunk in chunks for c in chunk.choices)
    assert (reasoning, *_reassemble(chunks)) == (m.reasoning_content, {}, "length", "")


def test_a_think_tag_in_a_message_is_not_the_templates(reasoning_client):
    """A user asking about "<think>" wrote the tag, not the template: the answer (thinking on,
    the template opening nothing) is content, whole and streamed alike; the tag read anywhere
    in the prompt put all of it in reasoning_content."""
    messages = [{"role": "user", "content": "What does the <think> tag mean?"}]
    kw = dict(model=NAME, messages=messages, max_tokens=8, temperature=0)
    m = reasoning_client.chat.completions.create(**kw).choices[0].message
    assert m.reasoning_content is None and m.content
    chunks = list(reasoning_client.chat.completions.create(stream=True, **kw))
    assert "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices) == m.content
    # The template's own closed block still closes it, after a message that writes </think>.
    m = reasoning_client.chat.completions.create(
        model=NAME, max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": "Say <think> then </think> then <think>"}],
        extra_body={"structured_outputs": {"regex": "[a-z]{3}"},
                    "chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert m.reasoning_content is None and re.fullmatch("[a-z]{3}", m.content)
    # The message the answer continues is part of what it follows: an open <think> there is.
    m = reasoning_client.chat.completions.create(
        model=NAME, max_tokens=8, temperature=0,
        messages=[*messages, {"role": "assistant", "content": "<think>\nLet me"}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False}
    ).choices[0].message
    assert m.reasoning_content and m.content is None


def test_completions_grammar_waits_for_the_thinking(reasoning_client):
    """/v1/completions too (vLLM's reasoner is the engine's, for every constrained request):
    the grammar applies after </think> unless the prompt closed the thinking; each prompt of a
    batch by its own, token ids as text. The text is not split (vLLM's completions have no
    reasoning_content)."""
    def answer(prompt):
        return reasoning_client.completions.create(
            model=NAME, prompt=prompt, max_tokens=12, temperature=0,
            extra_body={"structured_outputs": {"regex": "z{1,3}"}}).choices

    free = answer("Hello")[0]
    assert free.finish_reason == "length" and not re.fullmatch("z{1,3}", free.text), free
    closed = "Hello<think>\n\n</think>\n\n"
    assert re.fullmatch("z{1,3}", answer(closed)[0].text)
    choices = answer([_tokens(reasoning_client, closed), _tokens(reasoning_client, "Hello")])
    assert re.fullmatch("z{1,3}", choices[0].text) and choices[1].text == free.text, choices
    choices = answer(["Hello", closed, "Hi <think>"])
    assert [bool(re.fullmatch("z{1,3}", c.text)) for c in choices] == [False, True, False]


def _tokens(client, text: str) -> list[int]:
    url = str(client.base_url).removesuffix("/").removesuffix("v1") + "tokenize"
    r = httpx.post(url, json={"model": NAME, "prompt": text},
                   headers={"Authorization": f"Bearer {KEY}"})
    return r.raise_for_status().json()["tokens"]


def test_usage_counts_the_reasoning_tokens(reasoning_client):
    """usage.completion_tokens_details.reasoning_tokens (vLLM's, with a reasoning parser): the
    tokens between <think> and </think>, the tags not counted, over all choices; whole and in
    the streamed usage alike."""
    think, end = _tokens(reasoning_client, "<think></think>")
    letters = _tokens(reasoning_client, "ab")
    kw = dict(model=NAME, messages=MESSAGES, max_tokens=12, temperature=1.0, n=3,
              extra_body={"allowed_token_ids": [think, end, *letters], "seed": 20,
                          "return_token_ids": True})
    r = reasoning_client.chat.completions.create(**kw)

    def thinking(ids):
        if not ids or ids[0] != think:
            return 0
        return (ids.index(end) if end in ids else len(ids)) - 1

    expected = sum(thinking(c.token_ids) for c in r.choices)
    assert r.usage.completion_tokens_details.reasoning_tokens == expected
    # (this seed: one answer thinks, closes it and answers; one never thinks)
    assert any(c.token_ids[0] == think and end in c.token_ids for c in r.choices)
    assert any(thinking(c.token_ids) == 0 for c in r.choices) and expected
    chunks = list(reasoning_client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == expected


def test_reasoning_tokens_after_leading_whitespace(reasoning_client):
    """An answer opening "\\n<think>": the splitter reads the tag after the whitespace as the
    opening one (its thinking is reasoning_content), so usage counts that thinking too; it
    counted only a <think> that was the very first token (0 here), whole and streamed."""
    think, end = _tokens(reasoning_client, "<think></think>")
    (newline,), (letter,) = _tokens(reasoning_client, "\n"), _tokens(reasoning_client, "a")
    kw = dict(model=NAME, messages=MESSAGES, max_tokens=8, temperature=1.0, n=16,
              extra_body={"allowed_token_ids": [newline, think, end, letter], "seed": 0,
                          "return_token_ids": True, "logit_bias": {
                              str(newline): 8, str(think): 12, str(end): -3}})
    r = reasoning_client.chat.completions.create(**kw)

    def thinking(ids):
        while ids and ids[0] == newline:
            ids = ids[1:]
        if not ids or ids[0] != think:
            return 0
        return (ids.index(end) if end in ids else len(ids)) - 1

    # (this seed: some answers open with the newline, then <think>)
    assert any(c.token_ids[:2] == [newline, think] and c.message.reasoning_content
               for c in r.choices)
    expected = sum(thinking(c.token_ids) for c in r.choices)
    assert r.usage.completion_tokens_details.reasoning_tokens == expected
    chunks = list(reasoning_client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == expected
