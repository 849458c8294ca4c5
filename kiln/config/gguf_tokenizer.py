"""A GGUF file's tokenizer: transformers' conversion of its metadata, with what that conversion
misses, and the kept copy read back as it was saved (kiln/config/gguf_metadata.py keeps it)."""
from pathlib import Path

# llama.cpp's pre-tokenizer types that split every digit off before the GPT-2 regex
# (llama-vocab.cpp: "\p{N}" first), as their HF tokenizers do with Digits(individual_digits)
# before ByteLevel; transformers' conversion knows none of them and runs ByteLevel alone, so
# SmolLM2's "\n\n1" was "Ċ", "Ċ", "1" where HF and llama.cpp give "ĊĊ", "1" (spaces and
# newlines before a digit were each a token of their own).
DIGITS_FIRST_PRE_TYPES = ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
                          "minerva-7b", "mellum2")

# llama.cpp's pre-tokenizer types whose split transformers' conversion does not know either (it
# splits by the GPT-2 regex), each with the Split regex of its HF tokenizer.json (llama-vocab.cpp
# splits by the same): GLM-4's ("glm4", "chatglm-bpe") is Llama-3's, numbers cut in threes;
# Seed-Coder's ("seed-coder", Seed-OSS's too) cuts every digit alone and keeps a newline off
# punctuation. EXAONE-4's "exaone4" is llama.cpp's GPT-2 type, what the conversion does already
# (EXAONE-3's "exaone" splits digits first: DIGITS_FIRST_PRE_TYPES).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SEED_CODER_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                     r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+")
REGEX_SPLIT_PRE_TYPES = {"glm4": _LLAMA3_SPLIT, "chatglm-bpe": _LLAMA3_SPLIT,
                         "seed-coder": _SEED_CODER_SPLIT}


def convert(gguf: Path, table: dict):
    """transformers' tokenizer of `gguf`, its text split as llama.cpp's pre-tokenizer type
    (`table["tokenizer"]`, from gguf_metadata's tensor table) says where the conversion
    does not."""
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
    if info.get("model") == "gpt2":
        _split_as_llama_cpp(tok.backend_tokenizer, info.get("pre"))
    return tok


def _split_as_llama_cpp(backend, pre) -> None:
    import json

    from tokenizers import Regex, pre_tokenizers

    current = backend.pre_tokenizer
    described = json.dumps(json.loads(backend.to_str()).get("pre_tokenizer"))
    if current is None or '"Digits"' in described or '"Split"' in described:
        return  # a conversion that already splits this vocabulary's way
    if pre in DIGITS_FIRST_PRE_TYPES:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), current])
    elif pre in REGEX_SPLIT_PRE_TYPES:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(REGEX_SPLIT_PRE_TYPES[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


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
