"""OpenAI's limits on /v1/responses `metadata` (16 pairs, keys <= 64 characters, values <= 512)
and on a json_schema format's `name` (^[a-zA-Z0-9_-]{1,64}$, a string) are refused with a 400
naming the field; they were taken (metadata echoed whatever came, a name of 5 or "a b" passed)."""
import pytest

from .fake_api import assert_error
from .fake_api import client as chat_client  # noqa: F401
from .test_responses_fake_engine import client  # noqa: F401

SCHEMA = {"type": "object"}


@pytest.mark.parametrize("body,param", [
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata.k"),
    ({"text": {"format": {"type": "json_schema", "name": "a b", "schema": SCHEMA}}},
     "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "n" * 65, "schema": SCHEMA}}},
     "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "", "schema": SCHEMA}}},
     "text.format.name"),
])
def test_responses_limits_are_refused_naming_the_field(client, body, param):  # noqa: F811
    assert_error(client.post("/v1/responses", json={"input": "hi", **body}), 400, param)


def test_responses_within_the_limits_are_taken(client):  # noqa: F811
    # (this server takes bodies up to 4000 bytes: one key and one value at their limit)
    metadata = {**{f"k{i}": "v" for i in range(14)}, "k" * 64: "v", "long": "v" * 512}
    r = client.post("/v1/responses", json={
        "input": "hi", "max_output_tokens": 2, "metadata": metadata,
        "text": {"format": {"type": "json_schema", "name": "Ab_9-" * 12 + "abcd",
                            "schema": SCHEMA}}})
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == metadata


@pytest.mark.parametrize("name", [5, None, "a b", "n" * 65, ""])
def test_chat_response_format_name_is_checked(chat_client, name):  # noqa: F811
    r = chat_client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": name, "schema": SCHEMA}}})
    assert_error(r, 400, "response_format.json_schema.name")
