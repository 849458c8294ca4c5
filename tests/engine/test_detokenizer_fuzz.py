"""Streamed text equals a full decode at the prompt boundary, in byte runs, with added tokens.

Reference: decode(prompt context + output) less the context's own text, from where they first
differ (a prompt may end inside a character the output completes).
"""
import os
import random

import pytest

from kiln.engine.detokenizer import INITIAL_CONTEXT_TOKENS
from kiln.engine.stream_detokenizer import detokenizer_for_request

pytestmark = pytest.mark.usefixtures("detokenizer_kind")

FFFD = "\ufffd"


def expected(tok, prompt, ids, skip):
    ctx = list(prompt[-INITIAL_CONTEXT_TOKENS:])
    joined = tok.decode(ctx + ids, skip_special_tokens=skip)
    alone = tok.decode(ctx, skip_special_tokens=skip)
    return joined[len(os.path.commonprefix([joined, alone])):]


def stream(tok, prompt, ids, rng, skip):
    """Random-sized steps; returns (the deltas, the detokenizer)."""
    d = detokenizer_for_request(tok, prompt, skip_special_tokens=skip)
    deltas, i = [], 0
    while i < len(ids):
        k = rng.randint(1, 3)
        d.update(ids[i:i + k], final=i + k >= len(ids))
        i += k
        deltas.append(d.get_next_output_text(i >= len(ids), delta=True))
    return deltas, d


def byte_ids(tok, data: bytes):
    return [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in data]


@pytest.fixture(scope="module")
def tok_with_added(stories_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_end|>", "<|tool|>"]})
    tok.add_tokens(["<think>", " hello world", "日本"])
    return tok


def test_prompt_ending_inside_a_character_loses_no_output_text(tokenizer):
    """"Once upon" + <0xE6> | <0x97> <0xA5> "▁the" ...: the output completes "日"; the space
    and words after it must all come out."""
    words = tokenizer(" the cat sat", add_special_tokens=False).input_ids
    prompt = tokenizer("Once upon").input_ids
    for cut in (1, 2):
        e6_97_a5 = byte_ids(tokenizer, "日".encode())
        d = detokenizer_for_request(tokenizer, prompt + e6_97_a5[:cut])
        for t in e6_97_a5[cut:] + words:
            d.update([t])
        d.update([], final=True)
        assert d.output_text == "日 the cat sat", cut


@pytest.mark.parametrize("skip", [True, False])
def test_random_byte_runs_specials_and_added_tokens_after_random_prompts(tok_with_added, skip):
    tok = tok_with_added
    pool = byte_ids(tok, "€😀日".encode()) + [tok.convert_tokens_to_ids(t) for t in (
        "<|im_end|>", "<|tool|>", "<think>", " hello world", "日本", "<s>", "</s>")]
    for seed in range(120):
        rng = random.Random(seed)
        ids = [rng.choice(pool) if rng.random() < 0.5 else rng.randrange(len(tok))
               for _ in range(rng.randint(1, 20))]
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 4))]
        deltas, d = stream(tok, prompt, ids, rng, skip)
        want = expected(tok, prompt, ids, skip)
        assert "".join(deltas) == d.output_text == want, (seed, prompt, ids)
        assert FFFD in want or not any(FFFD in x for x in deltas), (seed, deltas)


@pytest.mark.parametrize("text", ["Hi 👋🏽 there 👨‍👩‍👧!", "日本語のテキスト、中文",
                                  "e\u0301 n\u0303 a\u0308", "𝔘𝔫𝔦 ☃ ✓",
                                  " two  spaces\n\nline\ttab"])
@pytest.mark.parametrize("prompt_text", ["", "Once upon a ti", "Hello 日"])
def test_multibyte_text_streams_whole_characters(tokenizer, text, prompt_text):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    prompt = tokenizer(prompt_text).input_ids if prompt_text else []
    deltas, d = stream(tokenizer, prompt, ids, random.Random(0), True)
    assert "".join(deltas) == expected(tokenizer, prompt, ids, True)
    assert not any(FFFD in x for x in deltas)
