"""Loads a GGUF file: dequantizes each tensor with `gguf` and renames llama.cpp names to HF ones.

llama.cpp stores Llama's q/k rows permuted for its rope layout (and Gemma's norms as 1 + w);
that is undone here, by each architecture's rules in gguf_names.py.
On CPU, linear weights in Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K also keep the file's blocks,
which small decode steps read instead of the float32 copy (kiln/model/layers/cpu_gemm.py).
"""
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kiln.errors import ConfigError
from kiln.logger import init_logger
from kiln.model.loader.gguf_names import (
    expert_tensors,
    gguf_sources,
    gguf_to_hf_name,
    norm_shift,
    permuted_heads,
    to_hf_shape,
    unpermute_rope_rows,
)

logger = init_logger(__name__)

# Rows dequantized per call: ~1 MB of float32 out, cache-sized (gguf-py goes 16 rows at a time,
# which costs its Python overhead 20,000 times for the default model: 3x slower to load).
_DEQUANT_CHUNK_ELEMS = 1 << 18


def _dequantize_in_chunks(raw: np.ndarray, qtype) -> np.ndarray | None:
    """gguf-py's own block dequantization over large row chunks (bit-identical to
    gguf.quants.dequantize); None for a type without a block class (F32, F16)."""
    import gguf

    quant = getattr(gguf.quants, qtype.name, None)
    if getattr(quant, "qtype", None) != qtype or not hasattr(quant, "dequantize_rows"):
        return None
    quant.init_grid()
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows = raw.reshape(-1, raw.shape[-1])
    row_elems = rows.shape[1] // type_size * block_size
    out = np.empty((rows.shape[0], row_elems), np.float32)
    step = max(1, _DEQUANT_CHUNK_ELEMS // row_elems)
    for start in range(0, rows.shape[0], step):
        out[start:start + step] = quant.dequantize_rows(rows[start:start + step]).reshape(
            -1, row_elems)
    return out.reshape(*raw.shape[:-1], row_elems)


def dequantize(raw: np.ndarray, qtype, name: str, path: Path) -> np.ndarray:
    """gguf-py's dequantization of one tensor, its failures named by tensor and type."""
    import gguf

    try:
        out = _dequantize_in_chunks(raw, qtype)
        return gguf.quants.dequantize(raw, qtype) if out is None else out
    except (NotImplementedError, ValueError, TypeError) as e:
        raise ConfigError(f"GGUF tensor {name} in {path} is stored as {qtype.name}, which Kiln "
                          f"cannot dequantize ({type(e).__name__}: {e}); use a file quantized "
                          "to F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 or a K-quant "
                          "(Q2_K to Q6_K)") from None


def iterate_gguf(path: Path, hf_config,
                 blocks: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor of a GGUF file Kiln has a parameter for.

    With `blocks`, each tensor stored in a type the CPU kernel reads is also put there as
    {HF name: (ggml type id, uint8 [rows, row_bytes] blocks, rows in HF order)}."""
    import gguf

    from kiln.config.gguf_checks import check_file
    from kiln.config.gguf_metadata import load_tensor_table
    from kiln.native.gguf_matmul import QTYPES

    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    table = load_tensor_table(path)  # parsed once per file, then read from Kiln's cache
    check_file(table, path)
    arch = table["architecture"]
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    data = np.memmap(path, mode="r")
    for t in table["tensors"]:
        hf_name = gguf_to_hf_name(t["name"], arch)
        if hf_name is None:
            logger.debug("GGUF tensor %s has no Kiln parameter; skipped", t["name"])
            continue
        # The bytes as gguf's reader presents them: elements, or rows of quantized blocks.
        raw = data[t["offset"]:t["offset"] + t["nbytes"]].view(t["dtype"]).reshape(t["shape"])
        qtype = gguf.GGMLQuantizationType(t["type"])
        values = dequantize(raw, qtype, t["name"], path)
        # An own, writable float32 array: F32 data is a view of the memmap (copied), a
        # dequantized one is already that (copying it again cost 0.07 s per start).
        if (values.dtype != np.float32 or not values.flags.writeable
                or np.may_share_memory(values, raw)):
            values = np.array(values, dtype=np.float32)
        heads = permuted_heads(arch, t["name"], num_heads, num_kv_heads)
        if heads is not None:
            values = unpermute_rope_rows(values, heads)
        if shift := norm_shift(arch, hf_name):
            values -= shift
        if blocks is not None and qtype.name in QTYPES and raw.ndim == 2:
            rows = raw if heads is None else unpermute_rope_rows(raw, heads)  # rows of blocks
            blocks[hf_name] = (QTYPES[qtype.name], torch.from_numpy(np.array(rows)))
        experts = expert_tensors(t["name"], values)
        if experts is not None:  # a stack [E, out, in]: each expert's own, as HF names them
            yield from ((name, torch.from_numpy(one)) for name, one in experts)
            continue
        yield hf_name, torch.from_numpy(np.ascontiguousarray(to_hf_shape(t["name"], values)))


def load_gguf_weights(model: nn.Module, path: Path, hf_config) -> None:
    from kiln.native import gguf_matmul

    weight = next(model.parameters())
    from kiln.distributed.parallel_state import get_tp_group

    # Under tensor parallelism each rank holds a slice of every weight: the whole file's blocks
    # do not fit it, so those ranks multiply by the dequantized slices instead.
    keep = (weight.device.type == "cpu" and gguf_matmul.available()
            and get_tp_group().world_size == 1)
    blocks: dict | None = {} if keep else None
    check_tensor_sizes(model, path, get_tp_group().world_size)
    check_tensors_present(model, path)
    from kiln.progress import progress

    model.load_weights(progress(iterate_gguf(path, hf_config, blocks), desc="loading weights",
                                unit=" tensors"))
    apply_rope_freqs(model, path)
    if blocks:
        attach_blocks(model, blocks)


def check_tensor_sizes(model: nn.Module, path: Path, tp_size: int) -> None:
    """Refuse a tensor of more values than the parameter it fills takes (whole, over the
    `tp_size` ranks), from the tensor table, before anything is dequantized: a damaged or
    mismatched file's huge tensor was dequantized whole, as float32, before the parameter's
    weight loader checked its shape, and the process was killed for memory. A tensor that
    passes is still checked exactly by that loader."""
    from kiln.config.gguf_metadata import load_tensor_table
    from kiln.model.checkpoint_names import merged_target

    params = dict(model.named_parameters(remove_duplicate=False))
    table = load_tensor_table(path)
    for t in table["tensors"]:
        hf_name = gguf_to_hf_name(t["name"], table["architecture"])
        target = None if hf_name is None else merged_target(hf_name)[0]
        if target not in params:  # not used, another stage's, or refused by load_weights
            continue
        values, room = int(np.prod(t["dims"])), params[target].numel() * tp_size
        if values > room:
            raise ConfigError(f"GGUF tensor {t['name']} in {path} has shape {tuple(t['dims'])} "
                              f"({values:,} values), more than its parameter {target} takes "
                              f"({room:,}); the file is damaged or does not match its metadata")


def check_tensors_present(model: nn.Module, path: Path) -> None:
    """Refuse a file lacking a tensor the model needs, naming the file and the llama.cpp names
    (load_weights' "checkpoint is missing model.layers.1.mlp.gate_up_proj.weight (shard 1)"
    named neither the file nor the tensor to look for in it)."""
    from kiln.config.gguf_metadata import load_tensor_table
    from kiln.model.checkpoint_names import checkpoint_parts

    table = load_tensor_table(path)
    present, arch = {t["name"] for t in table["tensors"]}, table["architecture"]
    tied = getattr(model, "tie_word_embeddings", False)
    fused = getattr(model, "fused_checkpoint_modules", ())
    missing = []
    for name, _ in model.named_parameters():
        if tied and name == "lm_head.weight":
            name = "model.embed_tokens.weight"  # a tied head is the embedding's tensor
        # a module the file may store fused (Phi-3's attn_qkv) or as its parts
        options = [[name]] if name.rsplit(".", 2)[-2] in fused else []
        options.append([part for part, _ in checkpoint_parts(name)])
        wanted = [[g for part in option for g in gguf_sources(part, arch)] for option in options]
        if not any(all(g is None or g in present for g in option) for option in wanted):
            missing += [g for g in wanted[0]
                        if g is not None and g not in present and g not in missing]
    if missing:
        raise ConfigError(f"GGUF file {path} lacks the tensor(s) {', '.join(missing[:8])}"
                          f"{' ...' if len(missing) > 8 else ''} that its metadata's model "
                          "needs; the file is incomplete or damaged, or its metadata (block "
                          "count, architecture) does not match its tensors")


def apply_rope_freqs(model: nn.Module, path: Path) -> bool:
    """Scale every rotary embedding by the file's `rope_freqs` tensor (Llama 3.1+ GGUFs keep
    their llama3 rope scaling there, not in metadata transformers reads); True if it had one."""

    from kiln.config.gguf_metadata import load_tensor_table
    from kiln.model.layers.rotary_embedding import RotaryEmbedding

    entry = next((t for t in load_tensor_table(path)["tensors"]
                  if t["name"] == "rope_freqs.weight"), None)
    if entry is None:
        return False
    factors = torch.from_numpy(read_tensor(path, entry))
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.divide_frequencies(factors.reshape(-1))
    return True


def read_tensor(path: Path, entry: dict) -> np.ndarray:
    """One tensor of the file (an entry of its tensor table), dequantized: float32."""
    import gguf

    data = np.memmap(path, mode="r")
    raw = data[entry["offset"]:entry["offset"] + entry["nbytes"]].view(entry["dtype"])
    qtype = gguf.GGMLQuantizationType(entry["type"])
    return np.array(dequantize(raw.reshape(entry["shape"]), qtype, entry["name"], path),
                    dtype=np.float32)


def attach_blocks(model: nn.Module, blocks: dict[str, tuple[int, torch.Tensor]]) -> int:
    """Give each linear weight whose every part the file stores in one kernel type its blocks
    (merged parts, such as q/k/v, concatenated in the merged order); returns how many."""
    from kiln.model.checkpoint_names import checkpoint_parts, merged_target
    from kiln.model.layers.cpu_gemm import attach_gguf_blocks
    from kiln.model.layers.vocab_embedding import embed_from_head_blocks

    params = dict(model.named_parameters(remove_duplicate=False))
    if getattr(model, "tie_word_embeddings", False):
        blocks = {k: v for k, v in blocks.items() if k != "lm_head.weight"}  # not loaded
    # Only weights that multiply (linears, the LM head; a tied embedding is the head's weight):
    # the layers that do hold the blocks.
    matmul_layers: dict[int, list[nn.Module]] = {}
    for m in model.modules():
        if getattr(m, "supports_cpu_packing", False):
            matmul_layers.setdefault(id(m.weight), []).append(m)
    parts: dict[str, list[str]] = {}  # weight name -> the HF names of its parts, in order
    for name in blocks:
        target, _ = merged_target(name)
        # a tensor the file stores fused (Phi-3's attn_qkv) is the merged weight's rows whole
        parts[target] = [name] if name == target else \
            [part for part, _ in checkpoint_parts(target)]
    count = 0
    for target, names in parts.items():
        param = params.get(target)
        if id(param) not in matmul_layers or any(n not in blocks for n in names):
            continue
        qtypes = {blocks[n][0] for n in names}
        if len(qtypes) != 1:
            continue
        qtype, rows = qtypes.pop(), torch.cat([blocks[n][1] for n in names])
        if all([attach_gguf_blocks(m, qtype, rows) for m in matmul_layers[id(param)]]):
            count += 1
    logger.info("kept the GGUF blocks of %d weights for small-batch CPU matmuls", count)
    embed_from_head_blocks(model)
    return count
