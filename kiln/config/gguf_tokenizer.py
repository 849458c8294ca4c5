"""A GGUF file's tokenizer: transformers' conversion of its metadata, with what that conversion
misses, and the kept copy read back as it was saved (kiln/config/gguf_metadata.py keeps it)."""
from pathlib import Path

# llama.cpp's pre-tokenizer types that split every digit off before the GPT-2 regex
# (llama-vocab.cpp: "\p{N}" first), as their HF tokenizers do with Digits(individual_digits)
# before ByteLevel; transformers' conversion knows none of them and runs ByteLevel alone, so
# SmolLM2's "\n\n1" was "Ċ", "Ċ", "1" where HF and llama.cpp give "ĊĊ", "1" (spaces and
# newlines before a digit were each a token of their own).
DIGITS_FIRST_PRE_TYPES = ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
                          "minerva-7b")


def convert(gguf: Path, table: dict):
    """transformers' tokenizer of `gguf`, digits split off where llama.cpp's pre-tokenizer
    type (`table["tokenizer"]`, from gguf_metadata's tensor table) says so."""
    from transformers import AutoTokenizer

    from kiln.config.gguf_arch_config import OWN_CONFIG_ARCHITECTURES
    from kiln.config.remote_code import checkpoint_code_message, needs_checkpoint_code
    from kiln.errors import ConfigError

    # AutoTokenizer converts the file's config first, which transformers cannot for these:
    # its GGUF tokenizer conversion itself (by tokenizer.ggml.model) runs without it
    reader = _backend_class() if table.get("architecture") in OWN_CONFIG_ARCHITECTURES \
        else AutoTokenizer
    try:
        # transformers reads the folder's tokenizer_config.json beside the file too: one naming
        # its own code (auto_map) made it ask on stdin and run that code on "y"
        tok = reader.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
    except ValueError as e:
        if not needs_checkpoint_code(e):
            raise
        raise ConfigError(f"{checkpoint_code_message(gguf.parent, 'tokenizer')} (its "
                          "tokenizer_config.json, read beside the GGUF file); move the .gguf "
                          "file to a folder of its own or pass a tokenizer with --tokenizer") \
            from None
    info = table.get("tokenizer") or {}
    if info.get("model") == "gpt2" and info.get("pre") in DIGITS_FIRST_PRE_TYPES:
        _split_digits_first(tok)
    return tok


def _split_digits_first(tok) -> None:
    import json

    from tokenizers import pre_tokenizers

    backend = tok.backend_tokenizer
    current = backend.pre_tokenizer
    described = json.dumps(json.loads(backend.to_str()).get("pre_tokenizer"))
    if current is None or '"Digits"' in described or '"Split"' in described:
        return  # a conversion that already splits this vocabulary's way
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), current])


def _backend_class():
    try:
        from transformers import TokenizersBackend  # transformers 5
        return TokenizersBackend
    except ImportError:  # 4.x
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast


def read(part: Path):
    """The kept tokenizer as converted: tokenizer.json holds its whole pipeline. Read back as
    its own class (AutoTokenizer), a transformers 5 class that builds its pipeline in __init__
    (Qwen2Tokenizer, every qwen2 and qwen3 file's) replaced the converted one: later starts
    NFC-normalized text the first did not ("e" + U+0301 gave other ids)."""
    try:
        from transformers import TokenizersBackend as reader  # transformers 5: the file as is
    except ImportError:  # 4.x: every fast class reads tokenizer.json as it is
        from transformers import AutoTokenizer as reader
    return reader.from_pretrained(part, trust_remote_code=False)
