"""What Kiln refuses in a GGUF file before transformers converts it or its weights load.

Each refusal names the file and what fixes it, where transformers or the model's loading would
fail without saying why: the second part of a split file has no general.architecture, the first
lacks the other parts' tensors ("checkpoint is missing 9 parameters"), and a mixture-of-experts
file lacks the dense MLP's. The checks read the tensor table (gguf_metadata.load_tensor_table),
which keeps the metadata they need (`metadata_keys`), so a start parses no file for them.
"""
from pathlib import Path

# The GGUF architectures Kiln's models run (general.architecture).
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# The model's shape: without these transformers takes its defaults (32 layers, ...).
_REQUIRED = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
_SPLIT_COUNT = "split.count"


def metadata_keys(arch: str | None) -> list[str]:
    """The metadata keys the checks read, kept in the tensor table."""
    return [_SPLIT_COUNT, f"{arch}.expert_count", *(f"{arch}.{key}" for key in _REQUIRED)]


def check_file(table: dict, gguf: Path) -> None:
    """Refuse a file Kiln's models cannot run: part of a split file, an architecture Kiln lacks
    (before transformers, whose refusal named neither the file nor what Kiln runs), a
    mixture of experts."""
    metadata = table["metadata"]
    split = metadata.get(_SPLIT_COUNT, {}).get("value")
    if isinstance(split, int) and split > 1:
        raise ValueError(f"GGUF file {gguf} is one of {split} parts of a split model "
                         f"({_SPLIT_COUNT} = {split}); Kiln does not read split files: merge "
                         "them into one with `llama-gguf-split --merge FIRST-PART.gguf "
                         "MERGED.gguf` and pass the merged file")
    arch = table["architecture"]
    if arch is None:
        raise ValueError(f"GGUF file {gguf} has no general.architecture field")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF file {gguf}: architecture {arch!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    experts = metadata.get(f"{arch}.expert_count", {}).get("value")
    expert_tensors = [t["name"] for t in table["tensors"] if "_exps." in t["name"]]
    if (isinstance(experts, int) and experts > 0) or expert_tensors:
        what = f"{arch}.expert_count = {experts}" if experts else f"tensor {expert_tensors[0]}"
        raise ValueError(f"GGUF file {gguf} holds a mixture-of-experts model ({what}); Kiln "
                         "runs dense models only (Llama, Mistral, Qwen2, Qwen3)")


def check_metadata(table: dict, gguf: Path) -> None:
    """Refuse metadata transformers would turn into a wrong config: a missing model shape
    (it fills in its defaults: a model of the wrong shape)."""
    arch = table["architecture"]
    missing = [key for key in metadata_keys(arch)[2:] if key not in table["metadata"]]
    if missing:
        raise ValueError(f"GGUF file {gguf} lacks the metadata {', '.join(missing)}; the file "
                         "is incomplete or was not written by a llama.cpp converter")
