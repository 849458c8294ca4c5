"""Streamed text equals a full decode at the prompt boundary, in byte runs, with added tokens.

Reference: tests/engine/released_text.py (the full decode but for byte runs whose released
characters a bad byte follows).
"""
import os
import random

import pytest

from kiln.engine.byte_runs import byte_token_values, final_prefix, valid_prefix
from kiln.engine.detokenizer import INITIAL_CONTEXT_TOKENS, skipped_special_ids
from kiln.engine.stream_detokenizer import detokenizer_for_request
from tests.engine.released_text import released_text

pytestmark = pytest.mark.usefixtures("detokenizer_kind")

FFFD = "\ufffd"


def expected(tok, prompt, ids, skip):
    return released_text(tok, prompt, ids, skip)


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


def test_a_prompts_own_characters_in_its_last_byte_run_are_not_the_outputs(tokenizer):
    """A prompt ending in "\n" as <0x0A> (a chat template's last token in Llama-2's
    vocabulary): an output of bytes that cannot be valid (a character cut off by max_tokens)
    decoded with it as one run, so the "\n" became a U+FFFD of the output's text (3 for 2
    bytes); one ending in 0x13 and half of 旟 gave the output "\x13旟"."""
    prompt = tokenizer("Once upon").input_ids
    for tail, out, want in ((b"\n", b"\xf0\x9f", FFFD * 2), (b"\x13\xe6", b"\x97\x9f", "旟"),
                            (b"\n", b"\xff", FFFD), (b"\n", "😀".encode() + b"\xff", "😀" + FFFD)):
        for steps in (1, len(out)):
            d = detokenizer_for_request(tokenizer, prompt + byte_ids(tokenizer, tail))
            ids = byte_ids(tokenizer, out)
            for k in range(0, len(ids), len(ids) // steps):
                chunk = ids[k:k + len(ids) // steps]
                d.update(chunk, final=k + len(chunk) >= len(ids))
            assert d.output_text == want, (tail, out, steps)


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


def test_an_all_emoji_reply_streams_each_character_when_its_last_byte_arrives(tokenizer):
    """Llama-2 / Mistral vocabularies spell 😀 as <0xF0><0x9F><0x98><0x80>. Kiln held a byte run
    until a non-byte token ended it, so a reply of emoji (or CJK by bytes) streamed nothing;
    vLLM releases each character with its last byte, and so does Kiln now."""
    text = "😀日€😀"
    ids = byte_ids(tokenizer, text.encode())
    d = detokenizer_for_request(tokenizer, tokenizer("Once upon").input_ids)
    deltas = []
    for t in ids:
        d.update([t])
        deltas.append(d.get_next_output_text(False, delta=True))
    assert [x for x in deltas if x] == list(text)
    ends = [len(text[:k + 1].encode()) - 1 for k in range(len(text))]
    assert [i for i, x in enumerate(deltas) if x] == ends


def test_a_bad_byte_after_released_characters_is_one_u_fffd(tokenizer):
    """The full decode turns a byte run with a bad byte into one U+FFFD a byte, the characters
    before it too; those went out already and stay: the rest of the run is U+FFFDs, released
    as soon as it cannot become valid."""
    prompt = tokenizer("Once upon").input_ids
    a = tokenizer("a", add_special_tokens=False).input_ids
    d = detokenizer_for_request(tokenizer, prompt)
    got = []
    for t in byte_ids(tokenizer, "😀".encode() + b"\xe6\xff\xe6") + a:
        d.update([t])
        got.append(d.get_next_output_text(False, delta=True))
    assert got == ["", "", "", "😀", "", FFFD * 2, FFFD, " a"]
    assert tokenizer.decode(prompt + byte_ids(tokenizer, "😀".encode() + b"\xe6\xff\xe6") + a
                            ).endswith(FFFD * 7 + " a")  # what the full decode shows


@pytest.mark.parametrize("skip", [True, False])
def test_random_byte_runs_release_whole_characters_at_their_last_byte(tok_with_added, skip):
    """One token a step: after each byte token the text out is the reference text up to the
    last whole character of the run (all of it once the run cannot become valid)."""
    tok = tok_with_added
    values = byte_token_values(tok)
    skipped = skipped_special_ids(tok) if skip else frozenset()
    plain = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|tool|>", "</s>", "日本")]
    for seed in range(150):
        rng = random.Random(seed)
        data = b"".join(rng.choice(["😀".encode(), "日".encode(), "€".encode(), b"a", b"\n",
                                    bytes([rng.randrange(256)])]) for _ in range(8))
        ids = byte_ids(tok, data)
        for _ in range(rng.randint(0, 3)):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(plain + [rng.randrange(len(tok))]))
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 3))]
        prompt += byte_ids(tok, bytes(rng.randrange(256) for _ in range(rng.randint(0, 2))))
        ctx = prompt[-INITIAL_CONTEXT_TOKENS:]
        d = detokenizer_for_request(tok, prompt, skip_special_tokens=skip)
        for i, t in enumerate(ids):
            d.update([t])
            if t not in values:
                continue
            everything = ctx + ids[:i + 1]
            run = []
            for j in range(len(everything) - 1, -1, -1):
                if everything[j] in values:
                    run.insert(0, j)
                elif everything[j] not in skipped:
                    break
            in_prompt = [j for j in run if j < len(ctx)]  # its final bytes are the prompt's
            run = run[final_prefix(bytes(values[everything[j]] for j in in_prompt)):]
            p, invalid = valid_prefix(bytes(values[everything[j]] for j in run))
            cut = len(everything) if invalid or p == len(run) else (
                run[p - 1] + 1 if p else run[0])
            want = released_text(tok, prompt, ids[:max(cut - len(ctx), 0)], skip)
            assert d.output_text == want, (seed, i, prompt, ids)
        d.update([], final=True)
        assert d.output_text == released_text(tok, prompt, ids, skip), (seed, prompt, ids)


def test_a_long_bad_byte_run_is_not_decoded_again_at_each_byte(tokenizer):
    """After the first bad byte each byte of the run is one U+FFFD; decoding the run's rest at
    every byte took quadratic time (3000 bytes: 4 s)."""
    d = detokenizer_for_request(tokenizer, tokenizer("Once").input_ids)
    calls = []
    decode = d._decode_ids
    d._decode_ids = lambda ids, **kw: calls.append(len(ids)) or decode(ids, **kw)
    for t in byte_ids(tokenizer, "😀".encode() + b"\xff" * 500):
        d.update([t])
    d.update(tokenizer("a", add_special_tokens=False).input_ids, final=True)
    assert d.output_text == "😀" + FFFD * 500 + " a"
    assert sum(calls) < 2000, (len(calls), sum(calls))


def _byte_level_bpe_with_hex_tokens():
    """A byte-level BPE whose vocabulary has tokens spelled "<0xE6>": text, not bytes (its
    decoder has no ByteFallback), as code or hex-dump training text can give."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab, merges = {"<|endoftext|>": 0}, []
    for c in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(c, len(vocab))
    for b in (0xE6, 0x97, 0xA5, 0xFF, 0x41, 0x9F, 0xF0, 0x98, 0x80):
        word = f"<0x{b:02X}>"
        for k in range(2, len(word) + 1):
            if word[:k] not in vocab:
                merges.append((word[:k - 1], word[k - 1]))
                vocab[word[:k]] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=False)


def test_tokens_spelled_like_bytes_in_a_byte_level_bpe_are_plain_text():
    """"<0x80>" then "Í" (the byte 0xCD, half a character) streamed "<0x80>�<0x80>�؇" for
    decode's "<0x80>�؇": the "<0x80>" token was taken for a byte-fallback token, its "run"
    split and its text given twice."""
    tok = _byte_level_bpe_with_hex_tokens()
    hexes = [i for t, i in tok.get_vocab().items() if len(t) == 6 and t.startswith("<0x")]
    assert len(hexes) == 9
    for seed in range(100):
        rng = random.Random(seed)
        ids = [rng.choice(hexes) if rng.random() < 0.7 else rng.randrange(len(tok))
               for _ in range(rng.randint(1, 20))]
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 4))]
        deltas, d = stream(tok, prompt, ids, rng, skip=True)
        ctx = prompt[-INITIAL_CONTEXT_TOKENS:]
        full, alone = (tok.decode(x, skip_special_tokens=True) for x in (ctx + ids, ctx))
        want = full[len(os.path.commonprefix([full, alone])):]
        assert "".join(deltas) == d.output_text == want, (seed, prompt, ids)
