"""/v1/responses end to end with the official `openai` client (client.responses.create, whole
and streamed) against a live `kiln serve`: greedy answers equal /v1/chat/completions' for the
same messages, streamed deltas make the whole text, a client leaving mid-stream is aborted; and
with --reasoning-parser the thinking comes back as a reasoning item, as chat's
reasoning_content."""
import json
import time

import httpx
import pytest

from .test_server_e2e import (
    KEY,
    NAME,
    _wait_for_abort,
    metric_samples,
)
from .test_structured_server import tiny_qwen_chat

openai = pytest.importorskip("openai")

CONVERSATIONS = [
    ("Once upon a time", None),
    ([{"role": "user", "content": "The little dog"}], "Tell a story"),
    ([{"role": "system", "content": [{"type": "input_text", "text": "Be kind"}]},
      {"role": "user", "content": [{"type": "input_text", "text": "Lily went"},
                                   {"type": "input_text", "text": "to the park"}]},
      {"type": "message", "role": "assistant",
       "content": [{"type": "output_text", "text": "She saw a cat", "annotations": []}]},
      {"role": "developer", "content": "Short answers"},
      {"role": "user", "content": "What next?"}], None),
]


def _as_chat(input, instructions) -> list[dict]:
    """The chat messages a Responses input stands for (text parts joined with newlines)."""
    items = [{"role": "user", "content": input}] if isinstance(input, str) else input
    messages = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        content = item["content"]
        if not isinstance(content, str):
            content = "\n".join(p["text"] for p in content)
        messages.append({"role": item["role"], "content": content})
    return messages


@pytest.fixture(scope="module")
def server(stories_chat_server):
    """The package's stories server (tests/server/conftest.py, shared with test_server_e2e; its
    responses store is on: background responses need it)."""
    return stories_chat_server()[0]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


@pytest.mark.parametrize("input,instructions", CONVERSATIONS)
@pytest.mark.parametrize("limit", [8, 400])
def test_greedy_answer_is_chats(client, input, instructions, limit):
    chat = client.chat.completions.create(model=NAME, messages=_as_chat(input, instructions),
                                          max_completion_tokens=limit, temperature=0)
    kw = dict(model=NAME, input=input, max_output_tokens=limit, temperature=0,
              metadata={"case": str(limit)}, **({"instructions": instructions}
                                                 if instructions else {}))
    resp = client.responses.create(**kw)
    choice = chat.choices[0]
    assert resp.output_text == choice.message.content
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.metadata == {"case": str(limit)} and resp.instructions == instructions
    # the token limit is "incomplete"; an answer that ended itself "completed"
    assert resp.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    if resp.status == "incomplete":
        assert resp.incomplete_details.reason == "max_output_tokens"
    assert (resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.total_tokens) == \
        (chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    assert resp.usage.output_tokens_details.reasoning_tokens == 0
    # streamed: the deltas make the whole text; the last event carries the whole response
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == resp.output_text
    last = events[-1]
    assert last.type == "response.completed" and last.response.status == resp.status
    assert last.response.output_text == text and last.response.usage == resp.usage
    assert last.response.output[0].status == resp.output[0].status


def test_an_answer_that_ends_itself_is_completed(client):
    """A grammar that ends (one of two JSON strings) ends the answer before its limit: completed,
    no incomplete_details, the stream's last event response.completed."""
    kw = dict(model=NAME, input="Yes or no?", max_output_tokens=40, temperature=0,
              text={"format": {"type": "json_schema", "name": "yn",
                               "schema": {"enum": ["yes", "no"]}}})
    resp = client.responses.create(**kw)
    assert resp.status == "completed" and resp.incomplete_details is None
    assert resp.output_text.strip() in ('"yes"', '"no"')
    assert resp.output[0].status == "completed"
    events = list(client.responses.create(stream=True, **kw))
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == resp.output_text


def test_the_sdks_stream_helper_has_the_final_response(client):
    """responses.stream()'s get_final_response() reads response.completed: a stream cut at
    max_output_tokens ends with it too (status incomplete), as vLLM's do."""
    kw = dict(model=NAME, input="Once upon a time", max_output_tokens=10, temperature=0)
    with client.responses.stream(**kw) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "incomplete" and final.output_text == deltas
    assert final.output_text == client.responses.create(**kw).output_text


def test_text_format_is_chats_response_format(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    messages = [{"role": "user", "content": "Give a number"}]
    chat = client.chat.completions.create(
        model=NAME, messages=messages, max_completion_tokens=30, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    resp = client.responses.create(
        model=NAME, input=messages, max_output_tokens=30, temperature=0,
        text={"format": {"type": "json_schema", "name": "n", "schema": schema}})
    assert resp.output_text == chat.choices[0].message.content
    assert resp.output_text.lstrip().startswith("{")
    assert resp.text.format.type == "json_schema"


def test_refusal_is_an_api_error(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=NAME, input="hi", previous_response_id="resp_x")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=NAME, input="hi", max_output_tokens=100000)
    assert e.value.body["param"] == "max_output_tokens"


def test_background_is_polled_to_the_foreground_answer(client):
    """The openai SDK's background flow: created queued, retrieved until done, the greedy
    answer the same as a foreground request's; a long one cancelled mid-run."""
    kw = dict(model=NAME, input="Once upon a time", max_output_tokens=24, temperature=0)
    fore = client.responses.create(**kw)
    resp = client.responses.create(background=True, **kw)
    assert resp.status == "queued" and resp.background is True
    deadline = time.monotonic() + 60
    while resp.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.02)
        resp = client.responses.retrieve(resp.id)
    assert resp.status == fore.status and resp.output_text == fore.output_text
    # (the prefix cache holds the prompt the second time)
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == \
        (fore.usage.input_tokens, fore.usage.output_tokens)
    long = client.responses.create(background=True, **dict(kw, max_output_tokens=480))
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(long.id) == cancelled


def test_leaving_mid_stream_aborts(server):
    before = metric_samples(server)
    free0 = before["kiln:kv_cache_free_blocks"]
    body = dict(model=NAME, input="Once upon a time", max_output_tokens=480, temperature=0,
                stream=True)
    with httpx.stream("POST", f"{server}/v1/responses", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == 6:
                break  # the connection closes mid-stream
    after = _wait_for_abort(server, before)
    assert after["kiln:kv_cache_free_blocks"] == free0
    # A client that gives up on a whole response is noticed too.
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server}/v1/responses", json={**body, "stream": False},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=0.3)
    after = _wait_for_abort(server, after)
    assert after["kiln:kv_cache_free_blocks"] == free0


# A template whose generation prompt opens the thinking (as DeepSeek-R1's does).
THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                     "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
                     "<|im_start|>assistant\n<think>\n{% endif %}")


def test_reasoning_item_is_chats_reasoning(tmp_path_factory, monkeypatch):
    """Through the server app in this process (a `kiln serve` start-up saved: the CLI's
    --reasoning-parser reaching the app is test_reasoning_server.py's), with _serve's engine."""
    from fastapi.testclient import TestClient

    from kiln.engine.arg_utils import EngineArgs
    from kiln.engine.async_llm import AsyncLLM
    from kiln.entrypoints.openai.api_server import build_app
    from kiln.entrypoints.openai.server_settings import ServerSettings

    model = tiny_qwen_chat(tmp_path_factory)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = THINKING_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    if (model / "chat_template.jinja").exists():  # where newer transformers save it
        (model / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "0")  # no core process to start
    llm = AsyncLLM.from_engine_args(EngineArgs(
        model=str(model), enforce_eager=True, max_model_len=2048, max_num_seqs=64,
        kv_cache_memory=0.05))
    settings = ServerSettings(api_key=KEY, served_model_names=[NAME], reasoning_parser="qwen3",
                              disable_any_whitespace=True)
    with TestClient(build_app(llm, settings)) as http:
        client = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key=KEY,
                               max_retries=0, http_client=http)
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        chat = client.chat.completions.create(model=NAME, messages=messages,
                                              max_completion_tokens=12, temperature=0)
        m = chat.choices[0].message
        kw = dict(model=NAME, input=messages, max_output_tokens=12, temperature=0)
        resp = client.responses.create(**kw)
        reasoning = [i for i in resp.output if i.type == "reasoning"]
        # the prompt opens the thinking and this random model never closes it: all it wrote
        # is reasoning, the message empty
        assert m.reasoning_content and reasoning
        assert reasoning[0].content[0].text == m.reasoning_content
        assert reasoning[0].id.startswith("rs_")
        assert resp.output_text == (m.content or "")
        assert resp.usage.output_tokens_details.reasoning_tokens == \
            chat.usage.completion_tokens_details.reasoning_tokens
        events = list(client.responses.create(stream=True, **kw))
        streamed = "".join(e.delta for e in events
                           if e.type == "response.reasoning_text.delta")
        assert streamed == (m.reasoning_content or "")
        assert events[-1].response.output_text == resp.output_text
        # whole and streamed alike: the item kinds and their statuses (cut while thinking,
        # both incomplete)
        assert [(i.type, i.status) for i in events[-1].response.output] == \
            [(i.type, i.status) for i in resp.output] == \
            [("reasoning", "incomplete"), ("message", "incomplete")]
        # The output sent back as history (vLLM's examples/online_serving/
        # openai_responses_client.py, OpenAI's `input += response.output`): the reasoning item
        # is the assistant turn's thinking, as chat's reasoning_content
        then = [{"role": "user", "content": "And in Rome?"}]
        again = client.responses.create(**{**kw, "input": messages + resp.output + then})
        chat = client.chat.completions.create(
            model=NAME, max_completion_tokens=12, temperature=0, messages=messages + [
                {"role": "assistant", "content": resp.output_text,
                 "reasoning_content": m.reasoning_content}] + then)
        assert again.usage.input_tokens == chat.usage.prompt_tokens
        assert again.output[0].content[0].text == chat.choices[0].message.reasoning_content


def test_cached_tokens_count_the_prefix_cache(client):
    """usage.input_tokens_details.cached_tokens: the prompt tokens the prefix cache held (always
    reported, as OpenAI and vLLM's Responses API do), the same prompt's second time."""
    kw = dict(model=NAME, input="Lily and Tom went to the park. " * 8, max_output_tokens=2,
              temperature=0)
    first = client.responses.create(**kw).usage
    again = client.responses.create(**kw).usage
    assert first.input_tokens == again.input_tokens > 32
    assert again.input_tokens_details.cached_tokens >= 32
    assert again.input_tokens_details.cached_tokens < again.input_tokens
