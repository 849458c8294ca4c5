"""encode_text gives exactly the ids of the tokenizer's own __call__, by the offset-free backend
path where the tokenizer is a plain fast one and by __call__ where it is anything else."""
import pytest

from kiln.config import gguf_metadata
from kiln.engine.text_encoding import encode_text
from tests.checkpoints import save_chat_tokenizer, save_tiny_tokenizer

TEXTS = ["", "w5", "  w3 w4\tw9  ", "w7 <s> w8 </s>", "unknown words w3",
         '{"name": "get_weather", "city": "Paris"} <|im_start|>user\nhi<|im_end|>',
         "<think>\n\n</think> héllo wörld 日本語 \U0001f600 " * 3, "x" * 5000]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer

    from kiln.model.loader.default_model import default_model_path

    words, chat = tmp_path_factory.mktemp("words"), tmp_path_factory.mktemp("chat")
    save_tiny_tokenizer(words)
    save_chat_tokenizer(chat)
    return {"words": AutoTokenizer.from_pretrained(words),
            "chat": AutoTokenizer.from_pretrained(chat),
            "default_model": gguf_metadata.load_tokenizer(default_model_path())}


def _backend_calls(tok, monkeypatch) -> list:
    calls = []
    real = tok.backend_tokenizer.encode_batch_fast
    # the backend is a Rust object: wrap it behind a Python one that records the call
    backend = type("Recording", (), {
        "encode_batch_fast": lambda self, *a, **k: calls.append(a) or real(*a, **k),
        "truncation": None, "padding": None,
        "encode_special_tokens": tok.backend_tokenizer.encode_special_tokens})()
    monkeypatch.setattr(type(tok), "backend_tokenizer", property(lambda self: backend))
    return calls


@pytest.mark.parametrize("name", ["words", "chat", "default_model"])
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_same_ids_as_the_tokenizer_call(tokenizers, name, add_special_tokens, monkeypatch):
    tok = tokenizers[name]
    expected = [list(tok(t, add_special_tokens=add_special_tokens).input_ids) for t in TEXTS]
    calls = _backend_calls(tok, monkeypatch)
    got = [encode_text(tok, t, add_special_tokens) for t in TEXTS]
    assert got == expected
    assert len(calls) == len(TEXTS)  # every text took the offset-free path
    assert all(isinstance(i, int) for ids in got for i in ids)


def test_a_tokenizer_that_splits_special_tokens_keeps_its_call(tokenizers, monkeypatch):
    tok = tokenizers["chat"]
    text = "<|im_start|>user hi<|im_end|>"
    whole = list(tok(text, add_special_tokens=False).input_ids)
    monkeypatch.setattr(tok, "split_special_tokens", True)
    try:  # the backend still encodes special tokens whole: encode_text must not use it as is
        got = encode_text(tok, text, add_special_tokens=False)
        assert got == list(tok(text, add_special_tokens=False).input_ids)
    finally:
        tok.backend_tokenizer.encode_special_tokens = False
    assert tok.convert_tokens_to_ids("<|im_end|>") in whole
    assert tok.convert_tokens_to_ids("<|im_end|>") not in got  # split, not one token


def test_a_backend_with_truncation_set_keeps_the_call(tokenizers):
    tok = tokenizers["words"]
    tok.backend_tokenizer.enable_truncation(2)
    try:  # __call__ turns the backend's truncation off for an untruncated call
        assert encode_text(tok, "w3 w4 w5 w6", False) == [3, 4, 5, 6]
    finally:
        tok.backend_tokenizer.no_truncation()


def test_a_class_that_overrides_the_encode_keeps_its_call(tokenizers):
    """CodeLlama's tokenizer overrides _encode_plus (fill-in-the-middle): its additions stay."""
    from transformers import BatchEncoding

    tok = tokenizers["words"]
    marked = type("Marked", (type(tok),), {
        "_encode_plus": lambda self, *a, **k: BatchEncoding({"input_ids": [9, 9]})})
    tok.__class__ = marked
    try:
        assert encode_text(tok, "w3 w4", False) == [9, 9]
    finally:
        tok.__class__ = marked.__mro__[1]
    assert encode_text(tok, "w3 w4", False) == [3, 4]


def test_a_tokenizer_without_a_backend_is_called():
    class Plain:
        def __call__(self, text, add_special_tokens):
            return type("Enc", (), {"input_ids": (7, len(text), int(add_special_tokens))})()

    assert encode_text(Plain(), "abc", True) == [7, 3, 1]
