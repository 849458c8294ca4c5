"""The bulk tokenizer process: the same response bytes as tokenizing here; deaths, hangs and
children that cannot start end in BulkTokenizerDied (the caller then tokenizes), never a hang."""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from kiln.engine import bulk_tokenizer
from kiln.engine.bulk_tokenizer import BulkTokenizer, BulkTokenizerDied, tokenize_response_json
from kiln.engine.text_encoding import encode_text, plain_backend

TEXT = "Once upon a time, a little <s> dog ran to the park.\n" * 2000  # ~100k characters


@pytest.fixture
def bulk(tokenizer):
    bulk = BulkTokenizer(plain_backend(tokenizer), niceness=1)
    yield bulk
    bulk.close()


def _here(tokenizer, text: str, special: bool) -> bytes:
    return tokenize_response_json(encode_text(tokenizer, text, add_special_tokens=special), 96,
                                  None)


@pytest.mark.parametrize("special", [True, False])
def test_the_child_s_body_is_the_one_built_here(tokenizer, bulk, special):
    assert bulk.tokenize_json(TEXT, special, 96) == _here(tokenizer, TEXT, special)
    assert bulk.tokenize_json("", special, 96) == _here(tokenizer, "", special)


def test_split_special_tokens_crosses_to_the_child(stories_dir):
    # a runtime flag of the backend, not in its JSON: `<s>` is then text, not BOS
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(stories_dir, split_special_tokens=True)
    bulk = BulkTokenizer(plain_backend(tokenizer))
    try:
        assert bulk.tokenize_json(TEXT, True, 96) == _here(tokenizer, TEXT, True)
    finally:
        bulk.close()


def test_the_child_runs_at_the_builder_s_priority_plus_the_niceness_restarts_too(bulk):
    expected = min(19, os.nice(0) + 1)
    bulk.tokenize_json("a", True, 8)
    assert os.getpriority(os.PRIO_PROCESS, bulk._proc.pid) == expected
    bulk._proc.kill()
    bulk._proc.wait()
    # started again from a thread already lowered by as much (the bulk lane's): not twice
    thread = threading.Thread(target=lambda: (os.nice(1), bulk.tokenize_json("a", True, 8)))
    thread.start()
    thread.join()
    assert os.getpriority(os.PRIO_PROCESS, bulk._proc.pid) == expected


def test_a_child_found_dead_is_started_again(tokenizer, bulk):
    expected = bulk.tokenize_json(TEXT, True, 96)
    first = bulk._proc
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert bulk.tokenize_json(TEXT, True, 96) == expected
    assert bulk._proc.pid != first.pid


def _child(monkeypatch, code: str) -> None:
    monkeypatch.setattr(bulk_tokenizer, "_child_command",
                        lambda niceness: [sys.executable, "-c", code])


def test_a_child_that_dies_mid_call_is_reported_then_replaced(tokenizer, bulk, monkeypatch):
    expected = bulk.tokenize_json(TEXT, True, 96)
    bulk.close()
    bulk = BulkTokenizer(plain_backend(tokenizer))
    with monkeypatch.context() as m:
        _child(m, "import sys; sys.stdin.buffer.read(8)")  # reads a little, answers nothing
        with pytest.raises(BulkTokenizerDied, match="did not answer"):
            bulk.tokenize_json(TEXT, True, 96)
    assert bulk._proc is None and bulk.unusable is None
    assert bulk.tokenize_json(TEXT, True, 96) == expected
    bulk.close()


def test_a_hung_child_is_killed_at_the_deadline(tokenizer, monkeypatch):
    _child(monkeypatch, "import time; time.sleep(60)")
    monkeypatch.setattr(bulk_tokenizer, "CALL_TIMEOUT_S", 0.5)
    bulk = BulkTokenizer(plain_backend(tokenizer))
    start = time.monotonic()
    with pytest.raises(BulkTokenizerDied, match="hung past 0.5 s"):
        bulk.tokenize_json(TEXT, True, 96)
    assert time.monotonic() - start < 10
    bulk.close()


def test_children_that_never_answer_are_given_up_after_a_few(tokenizer, monkeypatch):
    _child(monkeypatch, "pass")  # exits at once, as a child that cannot import would
    spawned = []
    popen = subprocess.Popen
    monkeypatch.setattr(bulk_tokenizer.subprocess, "Popen",
                        lambda *a, **k: spawned.append(1) or popen(*a, **k))
    bulk = BulkTokenizer(plain_backend(tokenizer))
    for _ in range(bulk_tokenizer.MAX_FAILURES):
        with pytest.raises(BulkTokenizerDied):
            bulk.tokenize_json("a", True, 8)
    assert bulk.unusable is not None and "3 times in a row" in bulk.unusable
    with pytest.raises(BulkTokenizerDied):
        bulk.tokenize_json("a", True, 8)
    assert len(spawned) == bulk_tokenizer.MAX_FAILURES  # no more children


def test_a_tokenizer_that_cannot_be_serialized_starts_no_child(monkeypatch):
    class Unserializable:
        def to_str(self):
            raise Exception("Custom PreTokenizer cannot be serialized")

    monkeypatch.setattr(bulk_tokenizer.subprocess, "Popen",
                        lambda *a, **k: pytest.fail("no child should start"))
    bulk = BulkTokenizer(Unserializable())
    bulk.start()  # does not raise: huge texts are then tokenized by the caller
    assert "cannot be serialized" in bulk.unusable
    with pytest.raises(BulkTokenizerDied, match="cannot start"):
        bulk.tokenize_json("a", True, 8)


def test_close_ends_the_child(bulk):
    bulk.tokenize_json("a", True, 8)
    proc = bulk._proc
    bulk.close()
    assert proc.returncode == 0 and bulk._proc is None
    bulk.close()  # twice is fine
    with pytest.raises(BulkTokenizerDied, match="shutting down"):
        bulk.tokenize_json("a", True, 8)


def test_close_does_not_wait_for_a_hung_call(tokenizer, monkeypatch):
    _child(monkeypatch, "import time; time.sleep(60)")
    bulk = BulkTokenizer(plain_backend(tokenizer))
    errors = []

    def call():
        try:
            bulk.tokenize_json(TEXT, True, 96)
        except BulkTokenizerDied as e:
            errors.append(e)
    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.5)
    start = time.monotonic()
    bulk.close()
    thread.join(10)
    assert time.monotonic() - start < 10 and not thread.is_alive() and len(errors) == 1
