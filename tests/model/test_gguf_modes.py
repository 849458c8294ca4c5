"""A GGUF file whose linears keep their blocks (gguf_linear, the few-row steps on the blocks):
mode 3 gives mode 0's greedy tokens, and so does gguf_linear with torch first (no blocks kept)
in mode 3 on the cache directory the default choice wrote (the choice is in the cache key)."""
from kiln import LLM, SamplingParams
from model.test_gguf_vs_hf import write_gguf

_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
            "output")
# a prefill above every type's block rows, then decode steps of 1-3 rows, which take the blocks
PROMPTS = [{"prompt_token_ids": [5, 17, 3, 99, 42, 7] * n} for n in (12, 2, 1)]


def _tokens(path, tok_dir, cache_dir, mode, **kw):
    llm = LLM(model=str(path), tokenizer=str(tok_dir), dtype="float32",
              max_num_batched_tokens=128, max_num_seqs=4, kv_cache_memory=0.05,
              compilation_config={"mode": mode, "cache_dir": str(cache_dir)}, **kw)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def test_gguf_blocks_compiled_and_torch_first_give_the_eager_tokens(
        tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))
    # The tokens, not the core's process, are the subject: three core interpreters spared.
    monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "0")
    path = write_gguf(tmp_path / "q8.gguf", tiny_llama_dir, {p: "Q8_0" for p in _LINEARS})
    eager = _tokens(path, tiny_llama_dir, tmp_path / "cc0", 0)
    assert _tokens(path, tiny_llama_dir, tmp_path / "cc3", 3) == eager
    torch_first = {"gguf_linear": ["torch"]}
    assert _tokens(path, tiny_llama_dir, tmp_path / "cc3", 3, ir_op_priority=torch_first) == eager


def test_a_tied_q8_0_table_read_from_the_heads_blocks_gives_the_dense_tables_tokens(
        tmp_path, monkeypatch):
    """The default model's shape: a tied Q8_0 token_embd. The embedding looks its rows up in the
    head's blocks (gguf_embedding) in modes 0 and 3, the dense table let go; with the op's torch
    reference first it keeps the dense table. All three give the same tokens."""
    from kiln.benchmarks.engine_probe import engine_model

    from checkpoints import make_tiny_checkpoint

    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))
    monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "0")  # to look at the model
    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "llama", tie=True)
    path = write_gguf(tmp_path / "tied.gguf", hf_dir,
                      {p: "Q8_0" for p in ("token_embd", *_LINEARS[:-1])})
    runs = {}
    for name, mode, kw in (("blocks0", 0, {}), ("blocks3", 3, {}),
                           ("dense", 0, {"ir_op_priority": {"gguf_embedding": ["torch"]}})):
        llm = LLM(model=str(path), tokenizer=str(hf_dir), dtype="float32",
                  max_num_batched_tokens=128, max_num_seqs=4, kv_cache_memory=0.05,
                  compilation_config={"mode": mode, "cache_dir": str(tmp_path / f"cc{mode}")},
                  **kw)
        embed = engine_model(llm.llm_engine).model.embed_tokens
        assert (embed.table_blocks is None) == (name == "dense"), name
        assert embed.weight.is_meta == (name != "dense"), name
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        runs[name] = [list(o.outputs[0].token_ids) for o in outs]
        llm.shutdown()
    assert runs["blocks0"] == runs["blocks3"] == runs["dense"]
