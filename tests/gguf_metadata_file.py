"""GGUF files of metadata alone (no tensors) for tests: an architecture's sizes and a gpt2-model
tokenizer as llama.cpp's converter writes one, enough for transformers to convert both."""


def write_metadata_gguf(path, arch: str, tokens, token_types, merges, eos_token_id: int,
                        pre: str | None = None):
    """Write `path`: every size 64, rms eps 1e-6, the tokenizer's tokens, their llama.cpp types
    (1 normal, 3 control), merges as "a b" strings and `pre` as tokenizer.ggml.pre."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for key in ("block_count", "context_length", "embedding_length", "feed_forward_length",
                "head_count", "head_count_kv"):
        getattr(w, f"add_{key}")(64)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(list(tokens))
    w.add_token_types(list(token_types))
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_eos_token_id(eos_token_id)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
