"""The bulk tokenizer process: the same response bytes as tokenizing here, a death survived."""
import os
import signal
import subprocess
import sys

import pytest

from kiln.engine.bulk_tokenizer import BulkTokenizer, BulkTokenizerDied, tokenize_response_json
from kiln.engine.text_encoding import encode_text, plain_backend

TEXT = "Once upon a time, a little <s> dog ran to the park.\n" * 2000  # ~100k characters


@pytest.fixture
def bulk(tokenizer):
    bulk = BulkTokenizer(plain_backend(tokenizer), niceness=1)
    yield bulk
    bulk.close()


@pytest.mark.parametrize("special", [True, False])
def test_the_child_s_body_is_the_one_built_here(tokenizer, bulk, special):
    here = tokenize_response_json(encode_text(tokenizer, TEXT, add_special_tokens=special), 96,
                                  None)
    assert bulk.tokenize_json(TEXT, special, 96) == here
    assert bulk.tokenize_json("", special, 96) == tokenize_response_json(
        encode_text(tokenizer, "", add_special_tokens=special), 96, None)


def test_the_child_runs_below_the_front_end_s_priority(bulk):
    bulk.tokenize_json("a", True, 8)
    assert os.getpriority(os.PRIO_PROCESS, bulk._proc.pid) >= min(19, os.nice(0) + 1)


def test_a_child_found_dead_is_started_again(tokenizer, bulk):
    expected = bulk.tokenize_json(TEXT, True, 96)
    first = bulk._proc
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert bulk.tokenize_json(TEXT, True, 96) == expected
    assert bulk._proc.pid != first.pid


def test_a_child_that_dies_mid_call_is_reported_then_replaced(tokenizer, bulk):
    expected = bulk.tokenize_json(TEXT, True, 96)
    bulk.close()
    # a child that reads the start of the request and exits without an answer
    bulk._proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.buffer.read(8)"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    with pytest.raises(BulkTokenizerDied, match="exited before answering"):
        bulk.tokenize_json(TEXT, True, 96)
    assert bulk._proc is None
    assert bulk.tokenize_json(TEXT, True, 96) == expected


def test_close_ends_the_child(bulk):
    bulk.tokenize_json("a", True, 8)
    proc = bulk._proc
    bulk.close()
    assert proc.returncode == 0 and bulk._proc is None
    bulk.close()  # twice is fine
