"""GGUF files Kiln cannot run, refused before transformers or the model's loading meets them:
each error names the file, what in it is wrong (the GGUF key and its value, the tensor) and what
to do, where they failed deep inside (a missing parameter, a ZeroDivisionError, transformers'
validator naming its own field)."""
import struct

import numpy as np
import pytest

from kiln.errors import ConfigError
from model._attn_helper import kiln_config_for
from model.test_gguf_vs_hf import write_gguf

from checkpoints import make_tiny_checkpoint


@pytest.fixture
def hf_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))
    return make_tiny_checkpoint(tmp_path / "hf", "llama", tie=False)


def test_a_split_file_is_refused_saying_to_merge_it(hf_dir, tmp_path):
    """The first part failed with "checkpoint is missing 9 parameters", the others with "no
    general.architecture"."""
    write_gguf(tmp_path / "m.gguf", hf_dir, split_max_tensors=12)
    parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(parts) > 1
    for part in parts:
        with pytest.raises(ConfigError, match=rf"{part.name} is one of {len(parts)} parts of a "
                                              r"split model \(split\.count = \d\).*"
                                              r"llama-gguf-split --merge"):
            kiln_config_for(part)


def test_a_llama_file_of_experts_without_their_count_is_refused(hf_dir, tmp_path):
    """Experts' stacked ffn_*_exps tensors for the dense MLP's, and no llama.expert_count to say
    the file is Mixtral's: it failed with "checkpoint is missing 6 parameter(s)"."""
    experts, dense = {}, []
    for layer in range(2):
        for part, shape in (("ffn_gate", (4, 128, 64)), ("ffn_up", (4, 128, 64)),
                            ("ffn_down", (4, 64, 128))):
            experts[f"blk.{layer}.{part}_exps.weight"] = np.zeros(shape, np.float32)
            dense.append(f"blk.{layer}.{part}.weight")
        experts[f"blk.{layer}.ffn_gate_inp.weight"] = np.zeros((4, 64), np.float32)
    path = write_gguf(tmp_path / "moe.gguf", hf_dir, extra=experts, skip=tuple(dense))
    with pytest.raises(ConfigError, match=r"moe\.gguf holds a mixture-of-experts model \(tensor "
                                          r"blk\.0\.ffn_gate_exps\.weight\); its llama\."
                                          r"expert_count .* is missing or not a positive "
                                          r"integer"):
        kiln_config_for(path)


def test_experts_of_an_architecture_kiln_runs_dense_only_are_refused(tmp_path):
    from kiln.config.gguf_checks import check_file

    table = {"architecture": "qwen2", "tensors": [],
             "metadata": {"qwen2.expert_count": {"type": "UINT32", "value": 8}}}
    with pytest.raises(ConfigError, match=r"m\.gguf holds a mixture-of-experts model \(qwen2\."
                                          r"expert_count = 8\); Kiln runs GGUF mixtures of "
                                          r"experts of the architectures llama \(Mixtral\), "
                                          r"qwen2moe and qwen3moe only, qwen2 files dense only"):
        check_file(table, tmp_path / "m.gguf")


@pytest.mark.parametrize("arch, served", [("phi2", "PhiForCausalLM"),
                                           ("command-r", "CohereForCausalLM")])
def test_gguf_of_a_family_kiln_serves_from_hf_only_names_the_hf_class(arch, served, tmp_path):
    """Phi-2 / Command-R GGUF files: refused naming the HF checkpoint Kiln does serve (their
    llama.cpp tensor layouts, fused qkv, LayerNorm biases, are not mapped)."""
    from kiln.config.gguf_checks import check_file

    table = {"architecture": arch, "tensors": [], "metadata": {}}
    with pytest.raises(ConfigError, match=rf"architecture '{arch}' is not supported; .* Kiln "
                                          rf"serves {served} from its Hugging Face checkpoint"):
        check_file(table, tmp_path / "m.gguf")


@pytest.mark.parametrize("key, entry, message", [
    ("qwen3moe.expert_used_count", None, r"lacks the metadata qwen3moe\.expert_used_count"),
    ("qwen3moe.expert_count", None, r"lacks the metadata qwen3moe\.expert_count"),
    ("qwen3moe.expert_used_count", (5, "UINT32"),
     r"qwen3moe\.expert_used_count \(5\) is more than qwen3moe\.expert_count \(4\)"),
    ("qwen3moe.expert_feed_forward_length", (0, "UINT32"),
     r"qwen3moe\.expert_feed_forward_length is 0; it must be above 0"),
])
def test_bad_expert_metadata_is_refused_naming_the_key(tmp_path, monkeypatch, key, entry,
                                                       message):
    """A top-k past the experts failed in the model's construction naming HF's
    num_experts_per_tok; a missing count took transformers' default (128 experts, top 8)."""
    from model.test_gguf_moe import write_moe_gguf

    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))
    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "qwen3_moe", tie=False)
    if entry is not None:
        entry = (entry[0], getattr(_types(), entry[1]))
    path = write_moe_gguf(tmp_path / "m.gguf", hf_dir, "qwen3_moe", metadata={key: entry})
    with pytest.raises(ConfigError, match=rf"GGUF file {path}:? {message}"):
        kiln_config_for(path)


def _types():
    import gguf

    return gguf.GGUFValueType


@pytest.mark.parametrize("key, entry, message", [
    ("llama.context_length", (0, "UINT32"), r"llama\.context_length is 0; it must be above 0"),
    ("llama.context_length", (-5, "INT32"), r"llama\.context_length is -5; it must be above 0"),
    ("llama.context_length", ("512", "STRING"),
     r"llama\.context_length is '512', stored as STRING where an integer belongs"),
    ("llama.block_count", (0, "UINT32"), r"llama\.block_count is 0; it must be above 0"),
    ("llama.attention.head_count", (0, "UINT32"),
     r"llama\.attention\.head_count is 0; it must be above 0"),
    ("llama.attention.head_count", (4.0, "FLOAT32"),
     r"llama\.attention\.head_count is 4\.0, stored as FLOAT32 where an integer belongs"),
    ("llama.attention.head_count_kv", ([2, 2], "ARRAY"),
     r"llama\.attention\.head_count_kv is an array of 2 values .*one value for the whole model"),
    ("llama.attention.layer_norm_rms_epsilon", ("1e-6", "STRING"),
     r"llama\.attention\.layer_norm_rms_epsilon is '1e-6', stored as STRING where a number"),
    ("tokenizer.ggml.eos_token_id", (100000, "UINT32"),
     r"tokenizer\.ggml\.eos_token_id is 100000, outside the vocabulary of \d+ tokens"),
    ("tokenizer.ggml.bos_token_id", (-1, "INT32"),
     r"tokenizer\.ggml\.bos_token_id is -1, a negative token id"),
    ("llama.rope.scaling.factor", (-2.0, "FLOAT32"),
     r"llama\.rope\.scaling\.factor is -2\.0; it must be 0 or above"),
    ("llama.rope.scale_linear", (float("inf"), "FLOAT32"),
     r"llama\.rope\.scale_linear is inf; it must be 0 or above"),
    ("llama.context_length", None, r"lacks the metadata llama\.context_length"),
    ("llama.attention.layer_norm_rms_epsilon", None,
     r"lacks the metadata llama\.attention\.layer_norm_rms_epsilon"),
])
def test_bad_metadata_is_refused_naming_the_key_and_value(hf_dir, tmp_path, key, entry,
                                                          message):
    """A context length of 0 failed in the rotary embedding, a head count of 0 as a
    ZeroDivisionError, a string or an array in transformers' validator (naming the HF field),
    an eos id past the vocabulary while generating; a missing context length or epsilon took a
    default (llama.cpp refuses both)."""
    if entry is not None:
        entry = (entry[0], getattr(_types(), entry[1]))
    path = write_gguf(tmp_path / "m.gguf", hf_dir, metadata={key: entry})
    with pytest.raises(ConfigError, match=rf"GGUF file {path}:? {message}"):
        kiln_config_for(path)


def test_the_default_model_has_all_the_metadata_checked(tmp_path, monkeypatch):
    """What the checks require, the real file (a llama.cpp conversion) carries."""
    from kiln.config import gguf_checks, gguf_metadata
    from kiln.model.loader.default_model import default_model_path

    path = default_model_path()  # under the real cache root, before the table goes elsewhere
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path))
    table = gguf_metadata.load_tensor_table(path)
    gguf_checks.check_file(table, path)
    gguf_checks.check_metadata(table, path)
    assert {"llama.context_length", "llama.attention.layer_norm_rms_epsilon",
            "tokenizer.ggml.eos_token_id"} <= table["metadata"].keys()


def test_a_quant_type_gguf_does_not_know_names_the_type_and_tensor(hf_dir, tmp_path):
    """A type id from a newer llama.cpp was reported as a truncated or damaged file, to be
    downloaded again: it is neither."""
    path = write_gguf(tmp_path / "m.gguf", hf_dir)
    data = bytearray(path.read_bytes())
    name = b"blk.0.attn_q.weight"  # its tensor info: name, dims count, dims, type id, offset
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 99)
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"m\.gguf: tensor blk\.0\.attn_q\.weight is stored in "
                                          r"quantization type 99, which the installed gguf "
                                          r"package \([\w.]+\) does not know.*upgrade it"):
        kiln_config_for(path)


def test_a_tensor_larger_than_its_parameter_is_refused_before_dequantizing(hf_dir, tmp_path,
                                                                           monkeypatch):
    """A tensor declaring many more rows (its bytes there: here a sparse file) was dequantized
    whole before its shape was checked: for a large one, the process was killed for memory."""
    import os

    import gguf

    from kiln.model.loader import get_model, gguf_loader

    path = write_gguf(tmp_path / "m.gguf", hf_dir)
    last = max(gguf.GGUFReader(str(path)).tensors, key=lambda t: t.data_offset)
    dims = [int(d) for d in last.shape]  # innermost first, as the file holds them
    dims[-1] *= 1000
    data = bytearray(path.read_bytes())
    name = last.name.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name) + 4
    struct.pack_into(f"<{len(dims)}Q", data, at, *dims)
    path.write_bytes(bytes(data))
    os.truncate(path, last.data_offset + int(np.prod(dims)) * 4)  # F32: the bytes are there
    cfg = kiln_config_for(path)
    calls = []
    dequantize = gguf_loader.dequantize
    monkeypatch.setattr(gguf_loader, "dequantize", lambda *a: calls.append(a[2]) or dequantize(*a))
    with pytest.raises(ConfigError, match=rf"GGUF tensor {last.name} in {path} has shape "
                                          r"\(\d+000,( \d+)?\) \([\d,]+ values\), more than its "
                                          r"parameter \S+ takes"):
        get_model(cfg)
    assert calls == []  # refused from the table, before any tensor was dequantized
