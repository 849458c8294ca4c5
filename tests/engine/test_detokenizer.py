"""Incremental detokenization equals a full decode; stop strings truncate and report."""
import random

import pytest

from kiln.engine.detokenizer import fast_decode, find_stop_string
from kiln.engine.stream_detokenizer import (
    FastIncrementalDetokenizer,
    IncrementalDetokenizer,
    detokenizer_for_request,
)
from tests.engine.released_text import released_text

pytestmark = pytest.mark.usefixtures("detokenizer_kind")


def stream(tokenizer, ids, rng, prompt=(), **kw):
    """Feed ids in random-sized chunks; return (concatenated deltas, detokenizer)."""
    d = detokenizer_for_request(tokenizer, list(prompt), **kw)
    text, i = "", 0
    while i < len(ids):
        k = rng.randint(1, 3)
        chunk, i = ids[i:i + k], i + k
        d.update(chunk, final=i >= len(ids))
        text += d.get_next_output_text(i >= len(ids), delta=True)
    return text, d


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_equals_full_decode_on_random_ids(tokenizer, skip):
    # Random ids hit byte-fallback runs, broken UTF-8 and specials inside byte runs.
    for seed in range(150):
        rng = random.Random(seed)
        ids = [rng.randrange(len(tokenizer)) for _ in range(40)]
        text, d = stream(tokenizer, ids, rng, skip_special_tokens=skip)
        full = released_text(tokenizer, [], ids, skip)
        assert text == full, (seed, ids)
        assert d.output_text == full


def test_an_added_special_token_inside_a_byte_run_is_skipped_as_decode_skips_it(stories_dir):
    """transformers lists only named specials in all_special_ids; an added token marked special
    (SmolLM2's <repo_name>) is skipped by the decode too, joining the byte runs around it. Taken
    as text, it ended the run: <0xE6> [CTRL] <0x97> <0xA5> went out as U+FFFDs, not "日"."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_dir)  # fresh: the ids are cached on it
    tok.add_tokens([AddedToken("[CTRL]", special=True)])
    ctrl = tok.convert_tokens_to_ids("[CTRL]")
    assert ctrl not in tok.all_special_ids
    the = tok.encode("the", add_special_tokens=False)
    ids = the + tok.convert_tokens_to_ids(["<0xE6>", "[CTRL]", "<0x97>", "<0xA5>"]) + the
    for skip in (True, False):
        text, d = stream(tok, ids, random.Random(0), skip_special_tokens=skip)
        assert text == d.output_text == tok.decode(ids, skip_special_tokens=skip)


def test_multibyte_character_is_not_streamed_half_done(tokenizer):
    ids = tokenizer("é ü 日本", add_special_tokens=False).input_ids
    d = detokenizer_for_request(tokenizer, [])
    pieces = []
    for t in ids:
        d.update([t])
        pieces.append(d.get_next_output_text(False, delta=True))
    d.update([], final=True)
    pieces.append(d.get_next_output_text(True, delta=True))
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_prompt_context_keeps_leading_space(tokenizer):
    prompt = tokenizer("Once upon a time").input_ids
    full = tokenizer("Once upon a time there was a dog").input_ids
    assert full[:len(prompt)] == prompt
    d = detokenizer_for_request(tokenizer, prompt)
    for t in full[len(prompt):]:
        d.update([t])
    assert d.output_text == " there was a dog"


def test_find_stop_string_only_in_new_text():
    assert find_stop_string("abc STOP def", 12, ["STOP"], False) == ("STOP", 4)
    assert find_stop_string("abc STOP def", 12, ["STOP"], True) == ("STOP", 8)
    # Already scanned: "STOP" lies entirely before the last 3 new characters.
    assert find_stop_string("abc STOP def", 3, ["STOP"], False) is None
    # Straddles the boundary between old and new text.
    assert find_stop_string("abc STOP", 2, ["STOP"], False) == ("STOP", 4)
    # The earliest of several stop strings wins.
    assert find_stop_string("x b a", 5, ["a", "b"], False) == ("b", 2)
    # not the list's first, as vLLM's would ("cd": the text "ab", itself a stop string)
    assert find_stop_string("abcd", 4, ["cd", "ab"], False) == ("ab", 0)


def test_the_stop_that_completes_first_wins_however_the_text_came():
    """"b" completes before "abc" does: one token "xabc" cut at "abc" (the earlier start) while
    the same text in one-character tokens cut at "b" (helper-46)."""
    assert find_stop_string("xabc", 4, ["b", "abc"], False) == ("b", 2)
    assert find_stop_string("xabc", 4, ["b", "abc"], True) == ("b", 3)
    assert find_stop_string("xabc", 4, ["bc", "abc"], False) == ("abc", 1)  # same end: longer
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice("abc") for _ in range(8))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 3))) for _ in range(3)]
        whole = find_stop_string(text, len(text), stops, False)
        one_by_one = next(filter(None, (find_stop_string(text[:i], 1, stops, False)
                                        for i in range(1, len(text) + 1))), None)
        assert whole == one_by_one, (text, stops)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates_output(tokenizer, include):
    ids = tokenizer("the dog ran to the park and sat", add_special_tokens=False).input_ids
    d = detokenizer_for_request(tokenizer, [], stop=["park"],
                                           include_stop_str_in_output=include)
    hit = None
    for n, t in enumerate(ids):  # noqa: B007 (n is read after the loop: where it stopped)
        hit = d.update([t])
        if hit:
            break
    assert hit == "park"
    assert n < len(ids) - 1
    assert d.output_text == ("the dog ran to the park" if include else "the dog ran to the ")


def test_stop_strings_wait_for_min_tokens(tokenizer):
    """As vLLM: a stop string counts only if it ends in text of a token after the
    min_tokens-th (eos and stop_token_ids wait the same way, in the sampler)."""
    text = "a b a b a b"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    cut_at = {}
    for min_tokens in (0, 1, 3):
        d = detokenizer_for_request(tokenizer, [], stop=["b"], min_tokens=min_tokens)
        for n, t in enumerate(ids, start=1):
            if d.update([t]):
                cut_at[min_tokens] = (n, d.output_text)
                break
    first_b = next(n for n in range(1, len(ids) + 1)
                   if "b" in tokenizer.decode(ids[:n]))
    assert cut_at[0][0] == cut_at[1][0] == first_b
    assert cut_at[3][0] > 3 and cut_at[3][0] > first_b
    assert cut_at[3][1] == tokenizer.decode(ids[:cut_at[3][0]]).rsplit("b", 1)[0]


def test_delta_holds_back_possible_stop_prefix(tokenizer):
    # "sto" could be the start of "stop!": it must not be streamed before the match resolves.
    ids = tokenizer("we stop! now", add_special_tokens=False).input_ids
    d = detokenizer_for_request(tokenizer, [], stop=["stop!"])
    streamed = ""
    for t in ids:
        hit = d.update([t])
        streamed += d.get_next_output_text(bool(hit), delta=True)
        assert "st" not in streamed
        if hit:
            break
    assert hit == "stop!"
    assert streamed == "we "


def _byte_level_bpe(**kwargs):
    """A small GPT-2 / Qwen / SmolLM style tokenizer: bytes decode lossily, no fallback runs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["héllo wörld 日本語 once upon a time there was a cat"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", **kwargs)


def test_incremental_equals_full_decode_byte_level_bpe():
    tokenizer = _byte_level_bpe()
    assert getattr(fast_decode(tokenizer), "__self__", None) is not tokenizer  # the backend's
    for seed in range(100):
        rng = random.Random(seed)
        ids = [rng.randrange(len(tokenizer)) for _ in range(30)]
        text, _ = stream(tokenizer, ids, rng, skip_special_tokens=True)
        assert text == tokenizer.decode(ids, skip_special_tokens=True), (seed, ids)


def test_transformers_decode_kept_where_it_does_more_than_the_backend():
    from transformers import PreTrainedTokenizerFast

    cleaned = _byte_level_bpe(clean_up_tokenization_spaces=True)
    assert fast_decode(cleaned) == cleaned.decode

    class Custom(PreTrainedTokenizerFast):
        def decode(self, *args, **kwargs):
            return super().decode(*args, **kwargs).upper()

    base = _byte_level_bpe()
    custom = Custom(tokenizer_object=base.backend_tokenizer, eos_token="<|endoftext|>")
    assert fast_decode(custom) == custom.decode
    ids = base("once upon a time", add_special_tokens=False).input_ids
    d = detokenizer_for_request(custom, [])
    d.update(ids, final=True)
    assert d.output_text == "ONCE UPON A TIME"


def test_fast_tokenizers_get_decode_stream_and_slow_ones_python(tokenizer, detokenizer_kind):
    """Where the tokenizer's decode is the backend's, DecodeStream runs (unless switched off);
    a tokenizer whose decode adds to the backend's keeps the Python detokenizer."""
    fast = detokenizer_kind == "decode_stream"
    d = detokenizer_for_request(tokenizer, [])
    assert isinstance(d, FastIncrementalDetokenizer) == fast
    cleaned = _byte_level_bpe(clean_up_tokenization_spaces=True)
    d = detokenizer_for_request(cleaned, [])
    assert type(d) is IncrementalDetokenizer
