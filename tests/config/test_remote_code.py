"""A checkpoint whose config or tokenizer names its own code (auto_map): Kiln refuses it
without asking on stdin and without running that code (transformers, left to decide, asked
"Do you wish to run the custom code? [y/N]" and ran the checkpoint's Python on "y")."""
import builtins
import json
import shutil

import pytest

from kiln.errors import ConfigError

CODE = ("import pathlib; pathlib.Path(__file__).with_name('RAN').touch()\n"
        "from transformers import {base}\n"
        "class {cls}({base}):\n    {attr}\n")


@pytest.fixture
def answer_yes(monkeypatch):
    """stdin says "y" to any question; the questions asked are recorded."""
    asked = []
    monkeypatch.setattr(builtins, "input", lambda prompt="": asked.append(prompt) or "y")
    return asked


def _edit(path, edit):
    values = json.loads(path.read_text())
    edit(values)
    path.write_text(json.dumps(values))


def test_a_config_needing_its_own_code_is_refused_unrun(tiny_llama_dir, tmp_path, answer_yes,
                                                        monkeypatch):
    from kiln.config import ModelConfig

    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))
    path = shutil.copytree(tiny_llama_dir, tmp_path / "m")
    _edit(path / "config.json", lambda c: c.update(
        model_type="foo_bar", architectures=["FooForCausalLM"],
        auto_map={"AutoConfig": "configuration_foo.FooConfig"}))
    (path / "configuration_foo.py").write_text(CODE.format(
        base="LlamaConfig", cls="FooConfig", attr="model_type = 'foo_bar'"))
    with pytest.raises(ConfigError, match=r"config\.json needs the checkpoint's own Python code "
                       r"\(auto_map\), and Kiln runs no code from checkpoints.*--trust-remote-"
                       r"code.*changes nothing.*serves .*LlamaForCausalLM"):
        ModelConfig(model=str(path), dtype="float32")
    assert answer_yes == [] and not (path / "RAN").exists()


def test_a_tokenizer_needing_its_own_code_is_refused_unrun(tiny_llama_dir, tmp_path,
                                                           answer_yes):
    from kiln.engine.tokenizer import load_tokenizer

    path = shutil.copytree(tiny_llama_dir, tmp_path / "m")
    _edit(path / "tokenizer_config.json", lambda c: c.update(
        tokenizer_class="FooTokenizer",
        auto_map={"AutoTokenizer": ["tokenization_foo.FooTokenizer", None]}))
    (path / "tokenization_foo.py").write_text(CODE.format(
        base="PreTrainedTokenizerFast", cls="FooTokenizer", attr="pass"))
    with pytest.raises(ConfigError, match=r"the tokenizer at .* needs the checkpoint's own Python "
                       r"code.*--trust-remote-code.*changes nothing.*with --tokenizer"):
        load_tokenizer(path)
    assert answer_yes == [] and not (path / "RAN").exists()


def _llama_gguf(path):
    """A llama GGUF of metadata alone (no tensors), its tokenizer a 4-token byte-level BPE:
    enough for transformers to convert its config and tokenizer (the default model's took a
    cold conversion of 49,152 tokens)."""
    from gguf_metadata_file import write_metadata_gguf

    return write_metadata_gguf(path, "llama", ["a", "b", "ab", "<|end|>"], [1, 1, 1, 3],
                               ["a b"], 3)


def test_a_gguf_beside_a_tokenizer_config_needing_its_own_code_is_refused_unrun(
        tmp_path, answer_yes, monkeypatch):
    """transformers reads the tokenizer_config.json in the GGUF file's folder too: one naming
    its own code asked on stdin and, on "y", loaded the folder's tokenizer class (its code
    ran), though the file's own tokenizer is complete."""
    from kiln.config import gguf_metadata

    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))
    folder = tmp_path / "m"
    folder.mkdir()
    gguf = _llama_gguf(folder / "m.gguf")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "FooTokenizer",
         "auto_map": {"AutoTokenizer": ["tokenization_foo.FooTokenizer", None]}}))
    (folder / "tokenization_foo.py").write_text(CODE.format(
        base="PreTrainedTokenizerFast", cls="FooTokenizer", attr="pass"))
    gguf_metadata.load_config(gguf)
    with pytest.raises(ConfigError, match=r"the tokenizer at .* needs the checkpoint's own Python "
                       r"code.*beside the GGUF file.*--tokenizer"):
        gguf_metadata.load_tokenizer(gguf)
    assert answer_yes == [] and not (folder / "RAN").exists()
