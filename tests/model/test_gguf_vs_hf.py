"""GGUF files with full llama.cpp metadata, made from tiny HF checkpoints: Kiln's logits from the
GGUF against HF's from the checkpoint, Llama 3 rope factors (`rope_freqs`), unsupported types.
"""
import numpy as np
import pytest
import torch

from kiln.errors import ConfigError
from kiln.model.loader import get_model
from model._attn_helper import (
    BlockPool,
    PagedRequest,
    allocate_kv_caches,
    build_step,
    kiln_config_for,
    run_step,
)
from model.test_gguf import llama_cpp_tensor

from checkpoints import make_tiny_checkpoint
from gguf_blocks import quantized_blocks

TOL = 1e-4
_LINEARS = ("token_embd", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
            "ffn_down", "output")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))


def write_gguf(path, hf_dir, types: dict | None = None, extra: dict | None = None,
               rope_scaling: tuple[str, float] | None = None, block_count: bool = True,
               metadata: dict | None = None, skip: tuple = (), split_max_tensors: int = 0):
    """hf_dir's weights as a llama GGUF with the metadata llama.cpp's converter writes (and a
    tiny vocabulary); `types`: llama.cpp name part -> F16 / BF16 / Q4_0 / Q4_1 / Q8_0 / any
    other raw type (zero blocks);
    `extra`: more tensors by GGUF name; `metadata`: key -> (value, GGUFValueType) written
    instead of the converter's, or None to leave the key out; `skip`: GGUF tensor names left
    out; `split_max_tensors`: split into parts (`path`'s stem-0000N-of-0000M.gguf)."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(hf_dir)
    w = gguf.GGUFWriter(str(path), "llama", split_max_tensors=split_max_tensors)
    if block_count:
        w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)  # as llama.cpp's converter writes them
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    if rope_scaling is not None:  # (type, factor), as llama.cpp's converter writes them
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling[0]))
        w.add_rope_scaling_factor(rope_scaling[1])
    w.add_vocab_size(c.vocab_size)
    tokens = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, c.vocab_size)]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([1] * len(tokens))
    for key, entry in (metadata or {}).items():
        w.kv_data[0].pop(key, None)
        if entry is not None:
            w.add_key_value(key, *entry)
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        gname, a = llama_cpp_tensor(name, t, c)
        if gname in skip:
            continue
        kind = (types or {}).get(gname.split(".")[-2], "F32")
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        if kind in ("F32", "F16"):
            data = a.astype(np.float32 if kind == "F32" else np.float16)
        elif kind == "BF16":
            data = gguf.quants.quantize(a, qtype)
        elif kind in ("Q4_0", "Q4_1", "Q8_0"):  # the values quantized
            data = quantized_blocks(a, kind)
        else:  # a type to be refused: right-sized zero blocks
            block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            data = np.zeros((a.shape[0], a.shape[1] // block_values * block_bytes), np.uint8)
        w.add_tensor(gname, data, raw_dtype=qtype)
    for gname, data in (extra or {}).items():
        w.add_tensor(gname, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def logits_diff(gguf_path, hf_dir, seq_len: int = 30, hf_attn: str | None = None,
                **config_kw) -> float:
    """Kiln on the GGUF (prefill, then 4 decode steps) vs HF on the checkpoint, max abs diff
    (hf_attn: HF's attn_implementation, "eager" for soft-capped attention)."""
    from transformers import AutoModelForCausalLM

    cfg = kiln_config_for(gguf_path, **config_kw)
    model = get_model(cfg)
    allocate_kv_caches(model, cfg, 64, 4)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                              attn_implementation=hf_attn).eval()
    seq = torch.randint(3, 512, (seq_len,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0]
    pool, req = BlockPool(64, 4), PagedRequest(seq)
    got = []
    for q in (seq_len - 4, 1, 1, 1, 1):
        ids, pos, md = build_step(pool, [req], [q])
        got.append(run_step(model, cfg, ids, pos, md))
    return (torch.cat(got) - ref).abs().max().item()


@pytest.mark.parametrize("kind", ["F32", "F16"])
def test_gguf_matches_hf_checkpoint_it_came_from(tmp_path, kind):
    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "llama", tie=False)
    if kind == "F16":  # the reference: the same weights rounded to float16
        from safetensors.torch import load_file, save_file
        state = load_file(str(hf_dir / "model.safetensors"))
        save_file({k: v.half().float() for k, v in state.items()},
                  str(hf_dir / "model.safetensors"))
    path = write_gguf(tmp_path / "m.gguf", hf_dir, {part: kind for part in _LINEARS})
    assert logits_diff(path, hf_dir) < TOL


def _llama3_factors(hf_dir) -> np.ndarray:
    """What llama.cpp's converter stores as rope_freqs: default frequency / llama3 frequency
    (computed here with transformers' own rope functions, not Kiln's)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(hf_dir)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    head_dim = config.hidden_size // config.num_attention_heads
    default = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    return (default / scaled).numpy().astype(np.float32)


def test_head_size_other_than_hidden_over_heads_is_read_from_the_file(tmp_path):
    """transformers' GGUF config drops `llama.attention.key_length`, and its default (hidden /
    heads) failed to load a file whose heads are another size (Mistral Nemo's)."""
    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "llama", tie=False, head_dim=32)
    path = write_gguf(tmp_path / "m.gguf", hf_dir)
    assert kiln_config_for(path).model_config.hf_config.head_dim == 32
    assert logits_diff(path, hf_dir) < TOL


def test_truncated_file_is_named(tmp_path):
    """An interrupted download failed with numpy's reshape error, naming neither the file nor
    what is wrong with it."""
    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "llama", tie=False)
    path = write_gguf(tmp_path / "m.gguf", hf_dir)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ConfigError, match=rf"GGUF file {path} \(\d+ bytes\) cannot be read .*"
                                          r"truncated or damaged"):
        kiln_config_for(path)


def test_llama3_rope_freqs_tensor_is_applied(tmp_path):
    """Llama 3.1+ GGUFs keep their rope scaling only as the `rope_freqs` tensor, which
    transformers' GGUF config ignores; it used to be skipped, so every position rotated wrong."""
    rope = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=16)
    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "llama", tie=False, rope_scaling=rope)
    factors = _llama3_factors(hf_dir)
    assert factors.max() == 8.0 and factors.min() < 8.0  # scaled and smoothed frequencies
    path = write_gguf(tmp_path / "m.gguf", hf_dir, extra={"rope_freqs.weight": factors})
    assert logits_diff(path, hf_dir) < TOL


def test_linear_rope_scaling_metadata_is_applied(tmp_path):
    """transformers' GGUF config drops `llama.rope.scaling.*`: a linearly scaled file ran
    unscaled, every position rotated wrong."""
    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "llama", tie=False,
                                  rope_scaling=dict(rope_type="linear", factor=4.0))
    path = write_gguf(tmp_path / "m.gguf", hf_dir, rope_scaling=("linear", 4.0))
    assert logits_diff(path, hf_dir) < TOL


def test_linear_rope_scaling_in_the_older_scale_linear_key_is_applied(tmp_path):
    """llama.cpp's converters of 2023 wrote a linear scaling as `llama.rope.scale_linear` alone
    (no rope.scaling.type, which llama.cpp then takes as linear): Kiln ran such a file
    unscaled, every position rotated wrong."""
    import gguf

    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "llama", tie=False,
                                  rope_scaling=dict(rope_type="linear", factor=4.0))
    path = write_gguf(tmp_path / "m.gguf", hf_dir, metadata={
        "llama.rope.scale_linear": (4.0, gguf.GGUFValueType.FLOAT32)})
    assert logits_diff(path, hf_dir) < TOL


@pytest.mark.parametrize("factor", [None, 0.0])
def test_a_rope_scaling_without_a_factor_is_no_scaling(tmp_path, factor):
    """llama.cpp reads a missing or 0 rope.scaling.factor as a scale of 1: Kiln failed with
    KeyError: 'factor' (missing) or built a rotary table of 0 positions (0)."""
    import gguf

    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "llama", tie=False)
    metadata = {"llama.rope.scaling.type": ("linear", gguf.GGUFValueType.STRING)}
    if factor is not None:
        metadata["llama.rope.scaling.factor"] = (factor, gguf.GGUFValueType.FLOAT32)
    path = write_gguf(tmp_path / "m.gguf", hf_dir, metadata=metadata)
    assert logits_diff(path, hf_dir) < TOL


def test_a_rotary_dimension_count_below_the_head_size_is_refused(tmp_path):
    """llama.cpp ropes only `rope.dimension_count` dimensions of each head (and refuses that for
    llama); Kiln ignored the key and roped whole heads, every position rotated wrong."""
    import gguf

    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "llama", tie=False)
    count = {"llama.rope.dimension_count": (16, gguf.GGUFValueType.UINT32)}  # the head size
    assert logits_diff(write_gguf(tmp_path / "whole.gguf", hf_dir, metadata=count),
                       hf_dir) < TOL
    count = {"llama.rope.dimension_count": (8, gguf.GGUFValueType.UINT32)}
    path = write_gguf(tmp_path / "m.gguf", hf_dir, metadata=count)
    with pytest.raises(ConfigError, match=rf"GGUF file {path}: llama\.rope\.dimension_count is "
                                          r"8, but Kiln's \w+ ropes 16 of each head's 16 "
                                          r"dimensions"):
        kiln_config_for(path)


def test_yarn_rope_scaling_metadata_is_refused(tmp_path):
    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "llama", tie=False)
    path = write_gguf(tmp_path / "m.gguf", hf_dir, rope_scaling=("yarn", 4.0))
    with pytest.raises(ConfigError, match="rope_scaling type 'yarn' is not supported"):
        get_model(kiln_config_for(path))


def test_rope_freqs_of_the_wrong_size_is_refused(tmp_path):
    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "llama", tie=False)
    path = write_gguf(tmp_path / "m.gguf", hf_dir,
                      extra={"rope_freqs.weight": np.ones(5, np.float32)})
    with pytest.raises(ConfigError, match=r"rope_freqs has shape \(5,\), expected \(8,\)"):
        get_model(kiln_config_for(path))


def test_unsupported_quant_type_names_tensor_and_type(tmp_path):
    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "llama", tie=False)
    path = write_gguf(tmp_path / "m.gguf", hf_dir, {"ffn_up": "Q8_1"})
    with pytest.raises(ConfigError, match=r"GGUF tensor blk\.0\.ffn_up\.weight .* stored as Q8_1"):
        get_model(kiln_config_for(path))


@pytest.mark.parametrize("skip", ["blk.1.ffn_up.weight", "blk.0.attn_k.weight",
                                  "output_norm.weight"])
def test_a_missing_tensor_is_named_with_the_file(tmp_path, skip):
    """The error named the merged parameter it fills ("checkpoint is missing 1 parameter(s):
    model.layers.1.mlp.gate_up_proj.weight (shard 1)"), neither the file nor the tensor."""
    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "llama", tie=False)
    path = write_gguf(tmp_path / "m.gguf", hf_dir, skip=(skip,))
    with pytest.raises(ConfigError, match=rf"GGUF file {path} lacks the tensor\(s\) "
                                          rf"{skip.replace('.', '[.]')} that"):
        get_model(kiln_config_for(path))


def test_missing_shape_metadata_is_named(tmp_path):
    """Without llama.block_count transformers took its default of 32 layers: the error was a
    list of 270 missing parameters."""
    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "llama", tie=False)
    path = write_gguf(tmp_path / "m.gguf", hf_dir, block_count=False)
    with pytest.raises(ConfigError, match=r"lacks the metadata llama\.block_count"):
        kiln_config_for(path)


def test_metadata_inconsistent_with_tensors_names_the_tensor(tmp_path):
    """A file whose head count disagrees with its q/k/v tensors fails naming one of them."""
    import gguf

    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "llama", tie=False)
    good = write_gguf(tmp_path / "good.gguf", hf_dir)
    reader = gguf.GGUFReader(str(good), "r+")
    reader.fields["llama.attention.head_count_kv"].parts[-1][0] = 4  # the tensors hold 2
    with pytest.raises(ConfigError, match=r"checkpoint tensor model\.layers\.0\.self_attn\.k_proj"
                                          r"\.weight: weight shape mismatch.*GGUF metadata"):
        get_model(kiln_config_for(good))


def test_gguf_format_for_a_directory_without_one_is_refused(tiny_llama_dir):
    with pytest.raises(FileNotFoundError, match=r"load_format='gguf'.*\.gguf"):
        get_model(kiln_config_for(tiny_llama_dir, load_format="gguf"))


def test_a_head_count_transformers_refuses_is_a_config_error_naming_the_file(tmp_path):
    """transformers' validators refuse heads that do not divide the embedding length with a
    StrictDataclassError, not a ValueError: `kiln generate` printed its traceback."""
    import gguf

    from kiln.errors import ConfigError

    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "llama", tie=False)
    path = write_gguf(tmp_path / "m.gguf", hf_dir,
                      metadata={"llama.attention.head_count": (3, gguf.GGUFValueType.UINT32)})
    with pytest.raises(ConfigError, match=rf"{path} is not a model config .*hidden size \(64\) "
                                          r"is not a multiple of the number of attention heads"):
        kiln_config_for(path)
