"""spaces_between_special_tokens=False: vLLM's detokenizer writes an added token that follows
another added token as its own text, without the decoder's spaces before it; both detokenizers
(DecodeStream and the Python one), streamed in chunks of any size, and the stop token too.

transformers 5 decodes ignore the flag (its slow tokenizers' join of v4 is gone), so the
expected texts are written out: the tiny test tokenizer's WordPiece decoder joins every token
with a space, which is what the flag takes out between special tokens.
"""
import random

import pytest

from kiln.engine.stream_detokenizer import detokenizer_for_request
from kiln.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("detokenizer_kind")

UNK, BOS, EOS = 0, 1, 2


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from checkpoints import save_tiny_tokenizer

    path = tmp_path_factory.mktemp("word_tokenizer")
    save_tiny_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def streamed(tokenizer, prompt, ids, seed, stop_terminated=False, **kw) -> tuple[str, str]:
    """(the deltas joined, output_text) for ids fed in chunks of 1 to 3."""
    d = detokenizer_for_request(tokenizer, list(prompt), skip_special_tokens=False, **kw)
    rng, text, i = random.Random(seed), "", 0
    while i < len(ids):
        k = rng.randint(1, 3)
        chunk, i = ids[i:i + k], min(i + k, len(ids))
        last = i == len(ids)
        d.update(chunk, final=last, stop_terminated=last and stop_terminated)
        text += d.get_next_output_text(last, delta=True)
    return text, d.output_text


@pytest.mark.parametrize("ids, spaced, joined", [
    ([7, BOS, EOS, UNK, 9, EOS, BOS, BOS], " w7 <s> </s> <unk> w9 </s> <s> <s>",
     " w7 <s></s><unk> w9 </s><s><s>"),
    # the first output token follows no added token (vLLM's), even after a prompt ending in one
    ([EOS, BOS, 7], " </s> <s> w7", " </s><s> w7"),
])
def test_no_spaces_between_added_tokens_in_a_row(word_tokenizer, ids, spaced, joined):
    prompt = word_tokenizer.encode("w5 w6", add_special_tokens=False) + [BOS]
    assert word_tokenizer.decode(prompt + ids)[len(word_tokenizer.decode(prompt)):] == spaced
    for seed in range(8):
        assert streamed(word_tokenizer, prompt, ids, seed) == (spaced, spaced)
        assert streamed(word_tokenizer, prompt, ids, seed,
                        spaces_between_special_tokens=False) == (joined, joined)


def test_the_stop_token_joins_too_and_skipped_specials_change_nothing(word_tokenizer):
    # EOS ends the request, its text kept (include_stop_str_in_output)
    text = streamed(word_tokenizer, [], [7, BOS, EOS], 0, stop_terminated=True,
                    spaces_between_special_tokens=False)
    assert text == ("w7 <s></s>",) * 2
    # skip_special_tokens=True: no special token is written, so none is joined (vLLM's rule)
    d = detokenizer_for_request(word_tokenizer, [], spaces_between_special_tokens=False)
    d.update([7, BOS, UNK, 9], final=True)
    assert d.output_text == word_tokenizer.decode([7, BOS, UNK, 9], skip_special_tokens=True)


def test_a_decoder_that_writes_no_spaces_is_unchanged():
    """stories260K's SentencePiece decoder (Llama 2's) writes added tokens with no space
    between them: the flag changes nothing there, as in vLLM."""
    from transformers import AutoTokenizer

    from checkpoints import STORIES_DIR

    tok = AutoTokenizer.from_pretrained(STORIES_DIR)  # SentencePiece: no spaces either
    ids = tok.encode("once upon", add_special_tokens=False) + [1, 2, 1] + tok.encode(
        "a time", add_special_tokens=False)
    full = tok.decode(ids)
    for seed in range(4):
        assert streamed(tok, [], ids, seed, spaces_between_special_tokens=False) == (full, full)


def test_the_flag_is_a_bool():
    assert not SamplingParams(spaces_between_special_tokens=False).spaces_between_special_tokens
    with pytest.raises(ValueError, match="^spaces_between_special_tokens must be True or False"):
        SamplingParams(spaces_between_special_tokens="no")
