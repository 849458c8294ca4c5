"""GGUF loading: llama.cpp names and quant types on a GGUF written here, and the real default model.

The tiny file is made from an HF checkpoint the way llama.cpp's converter does (q/k rows permuted).
"""
import json

import numpy as np
import pytest
import torch
from linear_calls import run_native

from kiln.ir import gguf_layout
from kiln.model.layers import cpu_gemm
from kiln.model.loader import build_model
from kiln.model.loader.gguf_loader import load_gguf_weights
from kiln.model.loader.gguf_names import gguf_to_hf_name, unpermute_rope_rows
from kiln.native import gguf_matmul, linear_op
from model._attn_helper import greedy_generate, kiln_config_for

from checkpoints import make_tiny_checkpoint
from gguf_blocks import quantized_blocks

# HF name part -> llama.cpp name part, and the storage type each gets in the test file.
_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_TYPES = {"token_embd": "Q8_0", "attn_q": "Q8_0", "attn_k": "F16", "attn_v": "BF16",
          "attn_output": "F32", "ffn_gate": "Q4_0", "ffn_up": "Q4_1", "ffn_down": "Q8_0",
          "output": "F32"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q/k rows (written independently here)."""
    out = np.empty_like(w)
    head_dim = w.shape[0] // n_head
    half = head_dim // 2
    for h in range(n_head):
        rows = w[h * head_dim:(h + 1) * head_dim]
        for i in range(half):  # interleave the two rope halves: row pairs (i, half + i)
            out[h * head_dim + 2 * i] = rows[i]
            out[h * head_dim + 2 * i + 1] = rows[half + i]
    return out


def gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        parts = hf_name.split(".")
        inner = ".".join(parts[3:-1])
        return f"blk.{parts[2]}.{_BLOCK[inner]}.{parts[-1]}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
            "output_norm.weight", "lm_head.weight": "output.weight"}[hf_name]


def llama_cpp_tensor(hf_name: str, t: torch.Tensor, hf_config) -> tuple[str, np.ndarray]:
    """(GGUF name, float32 values in llama.cpp's layout: q/k rows rope-interleaved)."""
    gname = gguf_name(hf_name)
    w = t.float().numpy()
    if ".attn_q." in gname:
        w = llama_cpp_permute(w, hf_config.num_attention_heads)
    elif ".attn_k." in gname:
        w = llama_cpp_permute(w, hf_config.num_key_value_heads)
    return gname, w


def write_tiny_gguf(path, hf_state: dict, hf_config, types: dict = _TYPES,
                    arch: str = "llama") -> dict:
    """Write hf_state as a llama GGUF (llama.cpp name part -> storage type in `types`, F32 when
    absent; K-quant tensors hold random blocks, see gguf_blocks); returns the float32 values a
    correct loader must produce. `arch`: the general.architecture it claims."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(hf_config.num_hidden_layers)
    expected = {}
    for name, t in hf_state.items():
        gname, w = llama_cpp_tensor(name, t, hf_config)
        qtype = getattr(gguf.GGMLQuantizationType, types.get(gname.split(".")[-2], "F32"))
        data = w if qtype == gguf.GGMLQuantizationType.F32 else quantized_blocks(w, qtype.name)
        writer.add_tensor(gname, data, raw_dtype=qtype)
        back = gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(w.shape)
        if ".attn_q." in gname or ".attn_k." in gname:  # expected in HF row order
            heads = hf_config.num_attention_heads if ".attn_q." in gname else \
                hf_config.num_key_value_heads
            back = unpermute_rope_rows(back, heads)
        expected[name] = torch.from_numpy(back)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    assert np.array_equal(unpermute_rope_rows(llama_cpp_permute(w, 3), 3), w)
    assert not np.array_equal(llama_cpp_permute(w, 3), w)


def test_name_mapping():
    assert gguf_to_hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert gguf_to_hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert gguf_to_hf_name("blk.1.attn_k_norm.weight") == "model.layers.1.self_attn.k_norm.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None


def _assert_loaded(model, expected: dict, num_layers: int) -> None:
    """Every parameter holds what write_tiny_gguf wrote for it, merged parts in order."""
    params = dict(model.named_parameters())
    merged = {"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("gate", "up")}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        for fused, parts in merged.items():
            prefix = p + fused.split(".")[0] + "."
            want = torch.cat([expected[f"{prefix}{x}_proj.weight"] for x in parts])
            assert torch.equal(params[f"{p}{fused}.weight"], want), f"{p}{fused}"
    for name, want in expected.items():
        if name in params:
            assert torch.equal(params[name], want), name


def test_tiny_gguf_loads_dequantized_weights(tiny_llama_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))
    cfg = kiln_config_for(tiny_llama_dir)
    hf_config = cfg.model_config.hf_config
    state = load_file(str(tiny_llama_dir / "model.safetensors"))
    expected = write_tiny_gguf(tmp_path / "tiny.gguf", state, hf_config)
    model = build_model(cfg)
    with torch.no_grad():
        load_gguf_weights(model, tmp_path / "tiny.gguf", hf_config)
    _assert_loaded(model, expected, hf_config.num_hidden_layers)
    params = dict(model.named_parameters())
    assert torch.equal(params["model.layers.0.self_attn.o_proj.weight"],
                       state["model.layers.0.self_attn.o_proj.weight"])  # F32: as saved
    assert torch.equal(params["lm_head.weight"], state["lm_head.weight"])
    # The F32 tensors are exact and the quantized ones close: rope rows must be in HF order.
    assert (params["model.layers.0.self_attn.qkv_proj.weight"][:16]
            - state["model.layers.0.self_attn.q_proj.weight"][:16]).abs().max() < 0.01


def _load_tiny(tiny_llama_dir, tmp_path, types: dict):
    """The tiny checkpoint written as GGUF with `types` and loaded as get_model would."""
    from safetensors.torch import load_file

    from kiln.model.layers.cpu_gemm import prepack_for_cpu

    cfg = kiln_config_for(tiny_llama_dir)
    hf_config = cfg.model_config.hf_config
    expected = write_tiny_gguf(tmp_path / "tiny.gguf",
                               load_file(str(tiny_llama_dir / "model.safetensors")), hf_config,
                               types)
    model = build_model(cfg)
    with torch.no_grad():
        load_gguf_weights(model, tmp_path / "tiny.gguf", hf_config)
        prepack_for_cpu(model)
    _assert_loaded(model, expected, hf_config.num_hidden_layers)
    return model, cfg


@pytest.mark.skipif(not gguf_matmul.available(), reason="the GGUF kernel needs AVX-512")
def test_blocks_kept_only_where_every_part_has_one_kernel_type(tiny_llama_dir, tmp_path,
                                                              monkeypatch):
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))
    model, _ = _load_tiny(tiny_llama_dir, tmp_path, _TYPES)
    kept = {f"{name}.weight" for name, m in model.named_modules() if cpu_gemm.held(m).blocks}
    # q Q8_0 / k F16 / v BF16 and gate Q4_0 / up Q4_1 do not merge into one type; o_proj is F32;
    # the Q8_0 embedding is no matmul weight here (this model's head has its own, F32).
    assert kept == {"model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"}


@pytest.mark.skipif(not gguf_matmul.available(), reason="the GGUF kernel needs AVX-512")
@pytest.mark.parametrize("linear_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_decode_steps_read_the_blocks_and_match_the_float_weights(
        tiny_llama_dir, tmp_path, monkeypatch, linear_type):
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))
    types = {part: linear_type for part in ("attn_q", "attn_k", "attn_v", "attn_output",
                                            "ffn_gate", "ffn_up", "ffn_down", "output")}
    model, cfg = _load_tiny(tiny_llama_dir, tmp_path, {**types, "token_embd": "Q8_0"})
    _assert_decode_reads_blocks(model, cfg)


def _assert_decode_reads_blocks(model, cfg, atol: float = 1e-5) -> None:
    """Every linear of the 2-layer tiny model keeps blocks in its float weight's row order (q/k
    un-permuted, parts merged; products within `atol`); decode steps, and only they, read them,
    with the floats' tokens."""
    linears = [m for m in model.modules() if getattr(m, "supports_cpu_packing", False)]
    assert len(linears) == 2 * 4 + 1 and all(cpu_gemm.held(m).blocks for m in linears)
    for m in linears:
        w = m.weight
        # the dense weight is the blocks' meaning (gguf_linear's reference) exactly
        assert torch.equal(gguf_layout.dequantize(m.cpu_blocks, m.cpu_qtype, *w.shape), w)
        x = torch.randn(min(3, cpu_gemm.held(m).block_rows), w.shape[1])
        before = linear_op.path_counts()["blocks"]
        got = run_native(m, x)
        assert linear_op.path_counts()["blocks"] == before + 1
        torch.testing.assert_close(got, x @ w.T, rtol=1e-5, atol=atol)
    # 66 tokens, more than any type's block rows: the prefill takes the floats
    prompt = [5, 17, 3, 99, 42, 7, 1, 250, 31, 8, 64] * 6
    assert len(prompt) > max(cpu_gemm.held(m).block_rows for m in linears)
    before = linear_op.path_counts()
    with_blocks = greedy_generate(model, cfg, prompt, max_new_tokens=6)
    calls = {p: n - before[p] for p, n in linear_op.path_counts().items()}
    # The prefill's 9 calls (8 linears, the head over all 66 rows) take the floats; the 5
    # decode steps' 9 each the blocks.
    assert calls == {"blocks": 5 * 9, "gemv": 0, "packed": 9, "dense": 0}
    for m in linears:  # the same model without its blocks: the float weights' tokens
        m.cpu_blocks = None
    assert greedy_generate(model, cfg, prompt, max_new_tokens=6) == with_blocks


@pytest.mark.skipif(not gguf_matmul.available(), reason="the GGUF kernel needs AVX-512")
def test_dense_copies_let_go_where_blocks_and_packed_serve(tiny_llama_dir, tmp_path,
                                                           monkeypatch):
    """A Q4_1 file's layers hold blocks (decodes) and a packed copy (prefills): the dense copy
    nobody reads is let go (a meta tensor, shape and dtype kept), each row count takes the path
    it took before, with the same values, and generation gives the same tokens."""
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))
    types = {part: "Q4_1" for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                       "ffn_up", "ffn_down", "output")}
    model, cfg = _load_tiny(tiny_llama_dir, tmp_path, {**types, "token_embd": "Q8_0"})
    linears = [m for m in model.modules() if getattr(m, "supports_cpu_packing", False)]
    prompt = [5, 17, 3, 99, 42, 7, 1, 250, 31, 8, 64] * 6  # more rows than the blocks serve
    want_tokens = greedy_generate(model, cfg, prompt, max_new_tokens=6)
    xs = {m: [torch.randn(rows, m.weight.shape[1]) for rows in (1, 3, 66)] for m in linears}
    want = {m: [run_native(m, x) for x in xs[m]] for m in linears}
    dense_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    embedding = model.model.embed_tokens.weight

    assert cpu_gemm.release_dense_copies(model) == dense_bytes  # the head's weight is its own
    assert all(m.weight.is_meta for m in linears) and not embedding.is_meta
    assert cpu_gemm.release_dense_copies(model) == 0  # nothing left to let go
    for m in linears:
        before = linear_op.path_counts()
        assert all(torch.equal(run_native(m, x), w) for x, w in zip(xs[m], want[m]))
        calls = {p: n - before[p] for p, n in linear_op.path_counts().items()}
        assert calls == {"blocks": 2, "gemv": 0, "packed": 1, "dense": 0}
    assert greedy_generate(model, cfg, prompt, max_new_tokens=6) == want_tokens
    from kiln.benchmarks.linear_floor import LinearFloor

    LinearFloor(model).run(3)  # reads shapes off the meta weights, makes inputs where they live


@pytest.mark.skipif(not gguf_matmul.available(), reason="the GGUF kernel needs AVX-512")
def test_shared_or_unpacked_weights_stay_dense(tiny_llama_dir, tmp_path, monkeypatch):
    """Nothing is let go where the dense copy is read: a weight the embedding shares (a tied
    head: the lookup reads it), a layer without a packed copy (its prefills read it)."""
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))
    types = {part: "Q4_1" for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                       "ffn_up", "ffn_down", "output")}
    model, _ = _load_tiny(tiny_llama_dir, tmp_path, {**types, "token_embd": "Q4_1"})
    head, embedding = model.lm_head, model.model.embed_tokens
    head.weight = embedding.weight  # tied, as the default model's head is
    assert cpu_gemm.held(head).blocks and cpu_gemm.held(head).packed
    unpacked = model.model.layers[0].self_attn.o_proj
    unpacked.cpu_packed = None
    cpu_gemm.release_dense_copies(model)
    assert not head.weight.is_meta and not embedding.weight.is_meta
    assert not unpacked.weight.is_meta
    assert model.model.layers[0].self_attn.qkv_proj.weight.is_meta


@pytest.mark.skipif(not gguf_matmul.available(), reason="the GGUF kernel needs AVX-512")
@pytest.mark.parametrize("main_type", ["Q4_K", "Q5_K"])
def test_k_quant_file_loads_and_decodes_from_its_blocks(tmp_path, monkeypatch, main_type):
    """A Q4_K_M- or Q5_K_M-style file (Q6_K for the down projections and the head; K-quant rows
    need 256-multiple widths, hence a wider tiny model): every tensor loads as dequantize gives
    it, every linear keeps its blocks, and decode steps read them, with the float weights'
    tokens."""
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))
    model_dir = make_tiny_checkpoint(tmp_path / "hf", "llama", tie=False, hidden_size=256,
                                     intermediate_size=512)
    types = {part: main_type for part in ("token_embd", "attn_q", "attn_k", "attn_v",
                                          "attn_output", "ffn_gate", "ffn_up")}
    model, cfg = _load_tiny(model_dir, tmp_path, {**types, "ffn_down": "Q6_K", "output": "Q6_K"})
    # random K-quant weights reach tens, so a 256-wide row's products reach the hundreds
    _assert_decode_reads_blocks(model, cfg, atol=1e-3)


def test_second_load_reads_the_tensor_table_not_the_file(tiny_llama_dir, tmp_path, monkeypatch):
    import gguf.gguf_reader
    from safetensors.torch import load_file

    from kiln.config import gguf_metadata

    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))
    cfg = kiln_config_for(tiny_llama_dir)
    hf_config = cfg.model_config.hf_config
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, load_file(str(tiny_llama_dir / "model.safetensors")), hf_config)

    model = build_model(cfg)

    def load():
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
            load_gguf_weights(model, path, hf_config)
        return {k: v.clone() for k, v in model.state_dict().items()}

    first = load()  # parses the file, keeps the table
    table = gguf_metadata.converted_dir(path) / "tensors" / "tensors.json"
    with monkeypatch.context() as m:
        m.setattr(gguf.gguf_reader.GGUFReader, "__init__",
                  lambda *a, **k: pytest.fail("the GGUF file was parsed again"))
        second = load()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    # A damaged table (here: an offset moved) is rebuilt from the file, not trusted.
    table.write_text(table.read_text().replace('"offset": ', '"offset": 1', 1))
    third = load()
    assert all(torch.equal(first[k], third[k]) for k in first)
    assert json.loads(table.read_text())["table"] == gguf_metadata._tensor_table(path)


def test_missing_gguf_file_names_path(tiny_llama_dir, tmp_path):
    cfg = kiln_config_for(tiny_llama_dir)
    model = build_model(cfg)
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf_weights(model, tmp_path / "nope.gguf", cfg.model_config.hf_config)


@pytest.mark.slow
def test_default_model_greedy_paris():
    from transformers import AutoTokenizer

    from kiln.model.loader import get_model
    from kiln.model.loader.default_model import default_model_path

    path = default_model_path()
    cfg = kiln_config_for(path)
    model = get_model(cfg)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    prompt = tok("The capital of France is")["input_ids"]
    out = greedy_generate(model, cfg, prompt, max_new_tokens=8)
    assert "Paris" in tok.decode(out)


@pytest.mark.slow
def test_default_model_matches_transformers():
    """transformers' own GGUF dequantization of the same file gives the same logits."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from kiln.config.hf_config_snapshot import as_transformers_config
    from kiln.model.loader import get_model
    from kiln.model.loader.default_model import default_model_path
    from model._attn_helper import BlockPool, PagedRequest, allocate_kv_caches, build_step, run_step

    path = default_model_path()
    cfg = kiln_config_for(path)
    model = get_model(cfg)
    # (HF's from_pretrained(gguf_file=...) needs accelerate; its converter alone does not.)
    hf = AutoModelForCausalLM.from_config(as_transformers_config(cfg.model_config.hf_config),
                                          dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf)["tensors"]
    missing, _ = hf.load_state_dict(tensors, strict=False)
    assert not [m for m in missing if m != "lm_head.weight"]
    hf.tie_weights()
    prompt = [1, 504, 3575, 282, 4649, 314, 7042, 30, 198]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    allocate_kv_caches(model, cfg, 16, 16)
    ids, pos, md = build_step(BlockPool(16, 16), [PagedRequest(prompt)], [len(prompt)])
    diff = (run_step(model, cfg, ids, pos, md) - ref).abs().max().item()
    assert diff < 1e-3, diff


@pytest.mark.skipif(not gguf_matmul.available(), reason="the GGUF kernel needs AVX-512")
def test_vocabulary_of_no_whole_groups_keeps_the_heads_blocks(tmp_path, monkeypatch):
    """The kernel holds weights in groups of 16 rows; a 500-word vocabulary (like Llama
    fine-tunes' 32001) pads the head's last group, and its decode steps still read the blocks."""
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))
    model_dir = make_tiny_checkpoint(tmp_path / "hf", "llama", tie=False, vocab_size=500)
    types = {part: "Q8_0" for part in ("token_embd", "attn_q", "attn_k", "attn_v",
                                       "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output")}
    model, cfg = _load_tiny(model_dir, tmp_path, types)
    assert model.lm_head.weight.shape[0] == 500
    _assert_decode_reads_blocks(model, cfg)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K",
                                   "BF16", "F16", "F32"])
def test_chunked_dequantization_is_gguf_pys_bit_for_bit(qtype, monkeypatch):
    """Large row chunks (3x faster loads) give exactly gguf-py's values; a chunk of 3 rows
    covers uneven tails."""
    import gguf

    from kiln.model.loader import gguf_loader

    monkeypatch.setattr(gguf_loader, "_DEQUANT_CHUNK_ELEMS", 3 * 512)
    kind = gguf.GGMLQuantizationType[qtype]
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    # Any bytes are some blocks (gguf-py cannot quantize K-quants to make them)
    raw = np.random.default_rng(0).integers(0, 256, (10, 512 // block_size * type_size),
                                            dtype=np.uint8)
    with np.errstate(all="ignore"):  # random scales: inf and nan, the same in both
        expected = gguf.quants.dequantize(raw, kind)
        got = gguf_loader.dequantize(raw, kind, "t", None)
    assert got.dtype == np.float32 and got.shape == expected.shape
    assert np.array_equal(got, expected.astype(np.float32), equal_nan=True)


def test_a_gguf_file_with_load_format_safetensors_names_the_flag(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file

    from kiln.config import ModelConfig

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, load_file(str(tiny_llama_dir / "model.safetensors")),
                    kiln_config_for(tiny_llama_dir).model_config.hf_config)
    with pytest.raises(ValueError, match="use --load-format gguf"):
        ModelConfig(model=str(path), load_format="safetensors")


def test_an_architecture_kiln_lacks_is_refused_naming_the_file_and_what_it_runs(
        tiny_llama_dir, tmp_path):
    """Before transformers reads the file: its own refusal ("GGUF model with architecture
    starcoder2 is not supported yet") named neither the file nor Kiln's architectures."""
    from safetensors.torch import load_file

    from kiln.config import ModelConfig

    path = tmp_path / "starcoder2.gguf"
    write_tiny_gguf(path, load_file(str(tiny_llama_dir / "model.safetensors")),
                    kiln_config_for(tiny_llama_dir).model_config.hf_config, arch="starcoder2")
    with pytest.raises(ValueError, match=r"starcoder2.gguf: architecture 'starcoder2' is not "
                       r"supported; supported: llama, mistral, qwen2, qwen3, phi3, gemma, "
                       r"gemma2, gemma3, granite, olmo2, smollm3, exaone4, glm4, seed_oss, "
                       r"ernie4_5, qwen2moe, qwen3moe; Kiln serves "
                       r"Starcoder2ForCausalLM from its Hugging Face checkpoint \(safetensors\), "
                       r"not GGUF"):
        ModelConfig(model=str(path))
