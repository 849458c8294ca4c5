"""Megabyte request bodies cost the event loop no Python work per item: token-id lists are
validated in pydantic's core, the prompt's union picks its member from the first item, bodies are
parsed by jiter, and long decodes release the GIL. Structure, not timing: Python calls are
counted (sys.setprofile)."""
import json
import sys
import threading
import time

import pytest
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError

from kiln.engine.async_llm import AsyncLLM
from kiln.engine.detokenizer import GIL_FREE_DECODE_IDS, fast_decode
from kiln.entrypoints.openai.api_server import ServerSettings, build_app
from kiln.entrypoints.openai.errors import _loc_to_param
from kiln.entrypoints.openai.json_body import JSONBodyRoute, parse_json
from kiln.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    PromptInput,
)
from kiln.entrypoints.openai.protocol_base import RequestPart
from kiln.entrypoints.openai.serving_completion import engine_prompts

from .fake_engine import FakeEngine

# Well above the few calls a validation makes (and a lazy import or GC callback adds), far
# below the 20,000 a Python call per item would.
FEW_CALLS = 200


def python_calls(fn) -> int:
    """Python function calls made while fn() runs on this thread (C and Rust calls not
    counted)."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_a_long_id_prompt_and_detokenize_body_validate_without_python_per_id():
    ids = list(range(20_000))
    for body in ({"model": "m", "prompt": ids}, {"model": "m", "prompt": [ids, ids]}):
        assert python_calls(lambda b=body: CompletionRequest.model_validate(b)) < FEW_CALLS
    assert python_calls(lambda: DetokenizeRequest.model_validate({"tokens": ids})) < FEW_CALLS
    # Text prompts too: the union no longer tries each member item by item.
    assert python_calls(lambda: CompletionRequest.model_validate(
        {"model": "m", "prompt": ["w"] * 20_000})) < FEW_CALLS


@pytest.mark.parametrize("prompt,expected", [
    ("text", "text"), ([], []), (["a", "b"], ["a", "b"]), ([1, 2], [1, 2]), ((1, 2), [1, 2]),
    ([1.0, 2], [1, 2]), ([[1], [2.0, 3]], [[1], [2, 3]]), ([[]], [[]])])
def test_prompt_shapes_validate_as_before(prompt, expected):
    value = TypeAdapter(PromptInput).validate_python(prompt)
    assert value == expected and all(type(t) is int for t in value if not isinstance(t, (str, list)))


@pytest.mark.parametrize("prompt", [[True], [1, "a"], ["a", 1], [1.5], 5, {"a": 1}, None,
                                    [[1], "a"], [["a"]]])
def test_bad_prompts_are_refused_naming_the_prompt(prompt):
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"model": "m", "prompt": prompt})
    first = info.value.errors()[0]
    assert _loc_to_param(("body", *first["loc"])) == "prompt", first


def test_token_ids_take_what_json_integers_are_and_refuse_the_rest():
    for good, value in ((7, 7), (7.0, 7)):
        assert DetokenizeRequest.model_validate({"tokens": [good]}).tokens == [value]
        assert type(DetokenizeRequest.model_validate({"tokens": [good]}).tokens[0]) is int
    for bad in (True, "7", 7.5, None, float("inf"), float("nan"), 1e20):
        with pytest.raises(ValidationError) as info:
            DetokenizeRequest.model_validate({"tokens": [bad]})
        (error,) = info.value.errors()  # one error, not one per union member
        assert error["msg"] == "must be an integer JSON number", error


def test_a_long_list_of_bad_ids_is_refused_at_its_first():
    # One error, not 20,000: pydantic built them all on the event loop before the 400.
    for bad in (0.5, True, "x"):
        with pytest.raises(ValidationError) as info:
            DetokenizeRequest.model_validate({"tokens": [1] + [bad] * 20_000})
        assert len(info.value.errors()) == 1
        for prompt in ([1] + [bad] * 20_000, [[1]] + [[bad]] * 20_000, ["a"] + [0.5] * 20_000):
            with pytest.raises(ValidationError) as info:
                CompletionRequest.model_validate({"model": "m", "prompt": prompt})
            assert len(info.value.errors()) == 1


def test_the_openapi_schema_of_ids_and_prompts_is_unchanged():
    schema = TypeAdapter(PromptInput).json_schema()
    assert schema == {"anyOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "string"}},
        {"type": "array", "items": {"type": "integer"}},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}]}
    assert DetokenizeRequest.model_json_schema()["properties"]["tokens"]["items"] == {
        "type": "integer"}


def test_engine_prompts_of_a_long_id_list_take_no_python_per_id():
    ids = list(range(20_000))
    assert python_calls(lambda: engine_prompts(ids)) < FEW_CALLS
    assert engine_prompts(ids) == [{"prompt_token_ids": ids}]


def test_many_chat_messages_validate_without_python_per_message():
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": None}]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi", "name": None},
                                       {"role": "user", "content": parts}] * 2_000}
    assert python_calls(lambda: ChatCompletionRequest.model_validate(body)) < FEW_CALLS
    with_null = {"model": "m", "messages": [{"role": "user", "content": "hi", "name": None}]}
    assert ChatCompletionRequest.model_validate(with_null).messages[0].name is None


def test_request_parts_need_no_null_rewrite():
    # What _null_is_default would do to them is nothing: every optional field defaults to None.
    def subclasses(cls):
        return [cls] + [s for c in cls.__subclasses__() for s in subclasses(c)]
    for model in subclasses(RequestPart)[1:]:
        for name, field in model.model_fields.items():
            assert field.is_required() or field.default is None, (model.__name__, name)


def _byte_level_tokenizer():
    from tests.engine.test_detokenizer import _byte_level_bpe
    return _byte_level_bpe()


def test_long_decodes_equal_the_tokenizers_and_release_the_gil():
    tokenizer = _byte_level_tokenizer()
    decode = fast_decode(tokenizer)
    ids = (tokenizer("once upon a time there was a cat", add_special_tokens=False).input_ids
           * (GIL_FREE_DECODE_IDS // 4))
    assert len(ids) >= GIL_FREE_DECODE_IDS
    for skip in (False, True):
        assert decode(ids, skip_special_tokens=skip) == tokenizer.decode(
            ids, skip_special_tokens=skip)
    # Released: another thread runs Python in the middle of a long decode.
    ids = ids * 200
    stamps, done = [], threading.Event()

    def other():
        while not done.is_set():
            now = time.perf_counter()
            if not stamps or now - stamps[-1] > 0.001:
                stamps.append(now)

    worker = threading.Thread(target=other)
    worker.start()
    try:
        while not stamps:
            time.sleep(0.001)
        start = time.perf_counter()
        decode(ids)
        end = time.perf_counter()
    finally:
        done.set()
        worker.join()
    quarter = (end - start) / 4
    middle = [t for t in stamps if start + quarter < t < end - quarter]
    assert middle, f"no other thread ran in the middle of a {end - start:.3f} s decode"


@pytest.mark.parametrize("body", [
    b'{"a": [1, 2.5, -0.0, 1e400, "x"]}', b'{"a": NaN, "b": -Infinity}', b'{"a": 1, "a": 2}',
    b'{"big": 123456789012345678901234567890}', b'\xef\xbb\xbf{"bom": 1}',
    '{"utf16": "é"}'.encode("utf-16"), b'{"lone": "\\ud800"}', b' [1] ', b'"\\u0000"'])
def test_bodies_parse_to_what_json_loads_gives(body):
    assert repr(parse_json(body)) == repr(json.loads(body))


@pytest.mark.parametrize("body", [b'{"a": 1}x', b"[1,2", b""])
def test_bad_bodies_raise_what_json_loads_raises(body):
    with pytest.raises(Exception) as ours:
        parse_json(body)
    with pytest.raises(Exception) as theirs:
        json.loads(body)
    assert type(ours.value) is type(theirs.value) and str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("body", [b'{"a": "\xff"}', b"[" * 100_000, b"9" * 5000])
def test_bodies_json_loads_cannot_read_raise_a_decode_error_saying_why(body):
    """json.loads raises UnicodeDecodeError, RecursionError or ValueError here, which FastAPI
    answers with a bare "There was an error parsing the body"."""
    with pytest.raises(json.JSONDecodeError) as e:
        parse_json(body)
    assert "UTF-8" in e.value.msg or "deeply" in e.value.msg or "digits" in e.value.msg


def test_every_served_route_parses_its_body_with_jiter():
    app = build_app(AsyncLLM(FakeEngine()), ServerSettings())
    posts = [r for r in app.routes if isinstance(r, APIRoute) and "POST" in r.methods]
    assert len(posts) >= 4 and all(isinstance(r, JSONBodyRoute) for r in posts), posts
