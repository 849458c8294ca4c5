"""A GGUF file's config and tokenizer: converted by transformers once, then read back from
Kiln's cache without parsing the file, identical in every way the engine uses them."""
import json
import os
import time
import unicodedata

import pytest

from kiln.config import gguf_metadata
from kiln.config.hf_config_snapshot import HFConfigSnapshot
from kiln.errors import ConfigError


@pytest.fixture(scope="module")
def default_gguf():
    from kiln.model.loader.default_model import default_model_path

    return default_model_path()  # under the real cache root, before a test moves it


@pytest.fixture(scope="module")
def direct(default_gguf):
    """transformers' own tokenizer and config of the default model's file (a parse each)."""
    from transformers import AutoConfig, AutoTokenizer

    return (AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name),
            AutoConfig.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name))


@pytest.fixture(scope="module")
def converted(default_gguf, tmp_path_factory):
    """A cache root where Kiln converted the default model's config and tokenizer and kept
    them (a parse each): (root, the first load's config, the first load's tokenizer)."""
    root = tmp_path_factory.mktemp("converted")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_CACHE_ROOT", str(root))
        return (root, gguf_metadata.load_config(default_gguf),
                gguf_metadata.load_tokenizer(default_gguf))


def _no_gguf_parsing(monkeypatch):
    import gguf.gguf_reader

    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF file was parsed again")
    monkeypatch.setattr(gguf.gguf_reader.GGUFReader, "__init__", refuse)


def test_second_load_reads_the_cache_and_matches_transformers(default_gguf, direct, converted,
                                                              monkeypatch):
    direct_tok, direct_cfg = direct
    monkeypatch.setenv("KILN_CACHE_ROOT", str(converted[0]))  # converted and kept there
    with monkeypatch.context() as m:
        _no_gguf_parsing(m)
        cfg = gguf_metadata.load_config(default_gguf)
        tok = gguf_metadata.load_tokenizer(default_gguf)
    def strip(d):
        return {k: v for k, v in d.items() if k != "transformers_version"}

    # The config comes back as plain data (no transformers class to import), equal field by
    # field to transformers' own, as JSON holds it.
    assert isinstance(cfg, HFConfigSnapshot)
    assert strip(cfg.to_dict()) == strip(json.loads(direct_cfg.to_json_string(use_diff=False)))
    assert cfg.num_hidden_layers == direct_cfg.num_hidden_layers
    assert cfg.rope_parameters == direct_cfg.rope_parameters
    assert type(tok) is type(direct_tok) and tok.get_vocab() == direct_tok.get_vocab()
    assert tok.all_special_ids == direct_tok.all_special_ids
    assert tok.name_or_path == direct_tok.name_or_path
    assert tok.eos_token_id == direct_tok.eos_token_id and tok.bos_token_id == direct_tok.bos_token_id
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        direct_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    for text in ["The capital of France is", " leading space, émigré 日本 <|im_end|>"]:
        ids = direct_tok(text)["input_ids"]
        assert tok(text)["input_ids"] == ids and tok.decode(ids) == direct_tok.decode(ids)


def test_damaged_copy_is_converted_again(default_gguf, converted, tmp_path, monkeypatch,
                                         caplog):
    import shutil

    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path))
    # A copy of the kept conversion (not converted again here), then each part damaged.
    shutil.copytree(converted[0] / "gguf", tmp_path / "gguf")
    part = gguf_metadata.converted_dir(default_gguf) / "config"
    assert (part / "config.json").is_file()
    (part / "config.json").write_text("{ not json")
    cfg = gguf_metadata.load_config(default_gguf)
    assert cfg.num_hidden_layers == 30 and "config.json" in os.listdir(part)
    assert '"num_hidden_layers": 30' in (part / "config.json").read_text()
    tokenizer_json = gguf_metadata.converted_dir(default_gguf) / "tokenizer" / "tokenizer.json"
    tokenizer_json.write_text('{"model": {"type": "nothing like a tokenizer"}}')
    tok = gguf_metadata.load_tokenizer(default_gguf)
    assert tok("The capital of France is")["input_ids"] == [504, 3575, 282, 4649, 314]


def test_a_changed_file_gets_a_new_conversion(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    first = gguf_metadata.converted_dir(f)
    assert first.parent == tmp_path / "gguf" and first.name.startswith("m-")
    f.write_bytes(b"GGUF v2")
    assert gguf_metadata.converted_dir(f) != first


@pytest.mark.parametrize("how", ["replaced", "edited"])
def test_a_file_changed_with_its_size_and_mtime_kept_gets_a_new_conversion(tmp_path, monkeypatch,
                                                                           how):
    """`cp -p`, `rsync -t` or `tar x` of a re-converted file of the same size, or an edit in
    place followed by os.utime, keep size and mtime: the old weights, config and tokenizer were
    used without a word."""
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF v1")
    before = f.stat()
    first = gguf_metadata.converted_dir(f)
    time.sleep(0.05)  # past the clock tick the kernel stamps ctime with
    if how == "replaced":  # as cp -p over a hard link, rsync -t and tar x do: a new inode
        new = tmp_path / "new.gguf"
        new.write_bytes(b"GGUF v2")
        os.replace(new, f)
    else:
        with open(f, "r+b") as out:
            out.write(b"GGUF v2")
    os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = f.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert gguf_metadata.converted_dir(f) != first


def _qwen2_gguf(path):
    """A qwen2 GGUF holding only metadata: checkpoints' byte-level chat tokenizer as llama.cpp's
    converter writes a gpt2-model one (tokens, types, merges), no tensors."""
    from transformers import AutoTokenizer

    from checkpoints import save_chat_tokenizer
    from gguf_metadata_file import write_metadata_gguf

    save_chat_tokenizer(path.parent / "hf")
    tok = AutoTokenizer.from_pretrained(path.parent / "hf")
    model = json.loads(tok.backend_tokenizer.to_str())["model"]
    tokens = sorted(tok.get_vocab(), key=tok.get_vocab().get)
    return write_metadata_gguf(path, "qwen2", tokens,
                               [3 if t.startswith("<|") else 1 for t in tokens],
                               model["merges"], tok.eos_token_id, pre="qwen2")


def test_a_qwen2_files_tokenizer_reads_back_as_converted(tmp_path, monkeypatch):
    """Read back as its class, Qwen2Tokenizer rebuilt the pipeline the conversion had made:
    later starts NFC-normalized, the first (and transformers) did not; "cafe" + U+0301 had
    other ids once the conversion was kept."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))
    path = _qwen2_gguf(tmp_path / "m.gguf")
    direct = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    first = gguf_metadata.load_tokenizer(path)
    with monkeypatch.context() as m:
        _no_gguf_parsing(m)
        again = gguf_metadata.load_tokenizer(path)
    text = "cafe\u0301 \u212b <|im_end|>"
    assert direct(text).input_ids != direct(unicodedata.normalize("NFC", text)).input_ids
    for tok in (first, again):
        assert json.loads(tok.backend_tokenizer.to_str()) == \
            json.loads(direct.backend_tokenizer.to_str())
        assert tok(text).input_ids == direct(text).input_ids
        assert tok.eos_token_id == direct.eos_token_id


@pytest.mark.parametrize("damage", ["truncated", "length"])
def test_a_damaged_tokenizer_file_is_named(tmp_path, monkeypatch, damage):
    """--tokenizer with a damaged GGUF (the model's own is checked before) failed with
    transformers' struct.error and a traceback, naming neither the file nor the fix."""
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))
    path = _qwen2_gguf(tmp_path / "m.gguf")
    data = path.read_bytes()
    # the first key's length (after magic, version and the two counts) made huge
    path.write_bytes(data[:len(data) // 2] if damage == "truncated" else
                     data[:24] + (2 ** 50).to_bytes(8, "little") + data[32:])
    with pytest.raises(ConfigError, match=rf"GGUF file {path} \(\d+ bytes\) cannot be read .*"
                                          "truncated or damaged"):
        gguf_metadata.load_tokenizer(path)


def test_smollm2_splits_digits_off_first_as_its_hf_tokenizer(default_gguf, direct, converted,
                                                             monkeypatch):
    """SmolLM2's HF tokenizer (and llama.cpp's "smollm" pre-tokenizer type) splits digits off
    before the GPT-2 regex; transformers' GGUF conversion knows no "smollm" and ran the regex
    alone: the spaces or newlines before a digit became a token each ("\\n\\n1": "Ċ", "Ċ",
    "1" where the model was trained on "ĊĊ", "1")."""
    import gguf
    from tokenizers import Tokenizer, models, pre_tokenizers

    fields = gguf.GGUFReader(default_gguf).fields
    assert fields["tokenizer.ggml.pre"].contents() == "smollm"
    vocab = {t: i for i, t in enumerate(fields["tokenizer.ggml.tokens"].contents())}
    merges = [tuple(m.split(" ")) for m in fields["tokenizer.ggml.merges"].contents()]
    hf = Tokenizer(models.BPE(vocab, merges))  # SmolLM2's tokenizer.json pipeline
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    texts = ["Steps:\n\n1. Mix", "a  1", "x   2024", "in 2024,  42 ", "v1.2.3\t\t7"]
    assert direct[0](texts[0]).input_ids != hf.encode(texts[0]).ids  # what transformers does
    first = converted[2]  # the converting load
    monkeypatch.setenv("KILN_CACHE_ROOT", str(converted[0]))
    again = gguf_metadata.load_tokenizer(default_gguf)  # read back from the cache
    for text in texts:
        assert first(text).input_ids == again(text).input_ids == hf.encode(text).ids, text


# Each type's split as its HF tokenizer.json writes it (GLM-4-9B's, Seed-Coder-8B's; EXAONE-4's is
# GPT-2's ByteLevel regex, Mellum-2's digits first), and the pieces it cuts "x 12345!\n" into.
_SPLITS = {
    "glm4": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
             ["x", "Ġ", "123", "45", "!Ċ"]),
    "seed-coder": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
                   r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
                   ["x", "Ġ", "1", "2", "3", "4", "5", "!", "Ċ"]),
    "exaone4": (None, ["x", "Ġ12345", "!", "Ċ"]),
    "mellum2": ("digits", ["x", "Ġ", "1", "2", "3", "4", "5", "!", "Ċ"]),  # as "smollm"
}


@pytest.mark.parametrize("pre", sorted(_SPLITS))
def test_a_pre_tokenizer_type_splits_as_its_hf_tokenizer(pre, tmp_path, monkeypatch):
    """GLM-4's ("glm4") and Seed-Coder's / Seed-OSS's ("seed-coder") files split by transformers'
    GPT-2 regex, which their HF tokenizers do not: numbers and the spaces before them were cut
    otherwise ("x 12345" gave "x", " 12345" where GLM-4's gives "x", " ", "123", "45").
    EXAONE-4's ("exaone4") is GPT-2's in llama.cpp too: left as converted. Mellum-2's
    ("mellum2") splits digits first, as SmolLM2's."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    from gguf_metadata_file import write_metadata_gguf

    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    texts = ["In 2024, 12345 people said: it's 42!\n\n1. Mix", "x  1 a 99 b\t\t7 I'LL we've 3.14"]
    trained = Tokenizer(models.BPE())  # merges across every split, so each split shows
    trained.pre_tokenizer = byte_level
    trained.train_from_iterator(texts * 4, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    model = json.loads(trained.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    path = write_metadata_gguf(tmp_path / "m.gguf", "llama", tokens + ["<|end|>"],
                               [1] * len(tokens) + [3], model["merges"], len(tokens), pre=pre)
    split, pieces = _SPLITS[pre]
    hf = Tokenizer(models.BPE(model["vocab"], [tuple(m.split(" ")) if isinstance(m, str) else
                                               tuple(m) for m in model["merges"]]))
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.pre_tokenizer = {
        None: gpt2,
        "digits": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2]),
    }.get(split) or pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
    first = gguf_metadata.load_tokenizer(path)
    again = gguf_metadata.load_tokenizer(path)
    for tok in (first, again):
        cut = tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("x 12345!\n")
        assert [piece for piece, _ in cut] == pieces
        for text in texts + ["x 12345!\n", "a.\n\n  7"]:
            assert tok(text).input_ids == hf.encode(text).ids, text


def test_a_negative_linear_rope_scaling_factor_is_refused_naming_it(tmp_path, monkeypatch):
    """A negative factor was accepted until the rotary cache of negative length failed on the
    ranks. (A missing or 0 factor is no scaling, as llama.cpp reads it: test_gguf_vs_hf.)"""
    import gguf

    from kiln.config import ModelConfig

    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))
    write_header = gguf.GGUFWriter.write_header_to_file

    def with_rope_scaling(self, *args, **kwargs):
        self.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        self.add_rope_scaling_factor(-2.0)
        return write_header(self, *args, **kwargs)
    monkeypatch.setattr(gguf.GGUFWriter, "write_header_to_file", with_rope_scaling)
    _qwen2_gguf(tmp_path / "m.gguf")
    with pytest.raises(ConfigError, match="rope.scaling.factor.*-2.0"):
        ModelConfig(model=str(tmp_path / "m.gguf"))
