"""What Kiln refuses in a GGUF file before transformers converts it or its weights load.

Each refusal names the file and what fixes it, where transformers or the model's loading would
fail without saying why: the second part of a split file has no general.architecture, the first
lacks the other parts' tensors ("checkpoint is missing 9 parameters"), experts in a file of an
architecture Kiln runs dense only lack the dense MLP's, and a size of 0, a string or an array
where a number belongs failed in the rotary embedding, as a ZeroDivisionError or in
transformers' validators (naming the HF field, not the file's). The checks read the tensor
table (gguf_metadata.load_tensor_table), which keeps the metadata they need (`metadata_keys`),
so a start parses no file for them.
"""
import math
from pathlib import Path

from kiln.errors import ConfigError

# The GGUF architectures Kiln's models run (general.architecture).
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2",
                                "gemma3", "granite", "olmo2", "smollm3", "exaone4", "glm4",
                                "seed_oss", "ernie4_5", "qwen2moe", "qwen3moe")
# llama.cpp architectures whose HF checkpoints Kiln serves, and their GGUF files not
_HF_ONLY = {"starcoder2": "Starcoder2ForCausalLM", "gptneox": "GPTNeoXForCausalLM",
            "phi2": "PhiForCausalLM", "command-r": "CohereForCausalLM"}
# <arch>.key -> what its value must be: "count" a positive integer, "positive" a number above 0,
# "scale" a number from 0 (a rope scaling factor: 0 is none, as llama.cpp reads it).
# Required: without the model's shape transformers takes its defaults (32 layers, ...); without
# the context length or the norm's epsilon llama.cpp refuses the file, transformers defaults.
_REQUIRED = {"block_count": "count", "context_length": "count", "embedding_length": "count",
             "feed_forward_length": "count", "attention.head_count": "count",
             "attention.layer_norm_rms_epsilon": "positive"}
_OPTIONAL = {"attention.head_count_kv": "count", "attention.key_length": "count",
             "attention.value_length": "count", "vocab_size": "count",
             "rope.freq_base": "positive", "rope.dimension_count": "count",
             "rope.scaling.factor": "scale",
             "rope.scale_linear": "scale"}
# A mixture of experts' (gguf_moe_config.is_moe): llama.cpp refuses a file without the counts.
_MOE_REQUIRED = {"expert_count": "count", "expert_used_count": "count"}
_MOE_OPTIONAL = {"expert_feed_forward_length": "count",
                 "expert_shared_feed_forward_length": "count"}
# Token ids the tokenizer and the engine use; each must be in the vocabulary.
_TOKEN_IDS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")
_TOKENS = "tokenizer.ggml.tokens"
_SPLIT_COUNT = "split.count"
_INTEGERS = ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64")
_FLOATS = ("FLOAT32", "FLOAT64")
_NOT_LLAMA_CPP = "the file is damaged or was not written by a llama.cpp converter"


def metadata_keys(arch: str | None) -> list[str]:
    """The metadata keys the checks read, kept in the tensor table."""
    return [_SPLIT_COUNT, f"{arch}.expert_count", *(f"{arch}.{key}" for key in _REQUIRED),
            *(f"{arch}.{key}" for key in _OPTIONAL), *_TOKEN_IDS, _TOKENS]


def check_file(table: dict, gguf: Path) -> None:
    """Refuse a file Kiln's models cannot run: part of a split file, an architecture Kiln lacks
    (before transformers, whose refusal named neither the file nor what Kiln runs), experts
    where Kiln runs the architecture dense only."""
    metadata = table["metadata"]
    split = metadata.get(_SPLIT_COUNT, {}).get("value")
    if isinstance(split, int) and split > 1:
        raise ConfigError(f"GGUF file {gguf} is one of {split} parts of a split model "
                          f"({_SPLIT_COUNT} = {split}); Kiln does not read split files: merge "
                          "them into one with `llama-gguf-split --merge FIRST-PART.gguf "
                          "MERGED.gguf` and pass the merged file")
    arch = table["architecture"]
    if arch is None:
        raise ConfigError(f"GGUF file {gguf} has no general.architecture field")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        hint = (f"; Kiln serves {_HF_ONLY[arch]} from its Hugging Face checkpoint (safetensors), "
                "not GGUF" if arch in _HF_ONLY else "")
        raise ConfigError(f"GGUF file {gguf}: architecture {arch!r} is not supported; "
                          f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}{hint}")
    from kiln.config.gguf_moe_config import is_moe

    if is_moe(table):
        return
    experts = metadata.get(f"{arch}.expert_count", {}).get("value")
    expert_tensors = [t["name"] for t in table["tensors"] if "_exps." in t["name"]]
    if (isinstance(experts, int) and experts > 0) or expert_tensors:
        what = f"{arch}.expert_count = {experts}" if experts else f"tensor {expert_tensors[0]}"
        fix = (f"its {arch}.expert_count (the number of experts, which llama.cpp's converter "
               "writes) is missing or not a positive integer; convert the model again"
               if arch == "llama" else
               "Kiln runs GGUF mixtures of experts of the architectures llama (Mixtral), "
               f"qwen2moe and qwen3moe only, {arch} files dense only: serve the model's Hugging "
               "Face checkpoint instead")
        raise ConfigError(f"GGUF file {gguf} holds a mixture-of-experts model ({what}); {fix}")


def check_metadata(table: dict, gguf: Path) -> None:
    """Refuse metadata transformers would turn into a wrong config or one that fails deep in
    the engine: a missing model shape, context length or norm epsilon; a size that is not a
    positive integer (0, negative, a string, an array); a bos/eos token outside the vocabulary.
    Each error names the GGUF key and its value."""
    from kiln.config.gguf_moe_config import is_moe

    arch, metadata = table["architecture"], table["metadata"]
    required, optional = (_REQUIRED, _OPTIONAL) if not is_moe(table) else (
        {**_REQUIRED, **_MOE_REQUIRED}, {**_OPTIONAL, **_MOE_OPTIONAL})
    missing = [f"{arch}.{key}" for key in required if f"{arch}.{key}" not in metadata]
    if missing:
        raise ConfigError(f"GGUF file {gguf} lacks the metadata {', '.join(missing)}; "
                          f"{_NOT_LLAMA_CPP}")
    for key, kind in {**required, **optional}.items():
        entry = metadata.get(f"{arch}.{key}")
        problem = None if entry is None else _value_problem(entry, kind)
        if problem:
            raise ConfigError(f"GGUF file {gguf}: {arch}.{key} is {problem}; {_NOT_LLAMA_CPP}")
    if is_moe(table):
        used = metadata[f"{arch}.expert_used_count"]["value"]
        experts = metadata[f"{arch}.expert_count"]["value"]
        if used > experts:
            raise ConfigError(f"GGUF file {gguf}: {arch}.expert_used_count ({used}) is more "
                              f"than {arch}.expert_count ({experts}); {_NOT_LLAMA_CPP}")
    vocab = metadata.get(_TOKENS, {}).get("count") or \
        metadata.get(f"{arch}.vocab_size", {}).get("value")
    for key in _TOKEN_IDS:
        entry = metadata.get(key)
        if entry is None:
            continue
        problem = _value_problem(entry, "id")
        if problem is None and vocab is not None and entry["value"] >= vocab:
            problem = f"{entry['value']}, outside the vocabulary of {vocab} tokens"
        if problem:
            raise ConfigError(f"GGUF file {gguf}: {key} is {problem}; {_NOT_LLAMA_CPP}")


def _value_problem(entry: dict, kind: str) -> str | None:
    """What is wrong with a summarised metadata value (gguf_metadata's {"type", "value" or
    "count"}) that must be `kind`: "count" (an integer above 0), "id" (an integer from 0),
    "positive" (a finite number above 0) or "scale" (a finite number from 0); None when
    nothing is."""
    if entry["type"] == "ARRAY":
        return (f"an array of {entry['count']} values (one per layer?), where Kiln needs one "
                "value for the whole model")
    value, integer = entry.get("value"), kind in ("count", "id")
    if entry["type"] not in (_INTEGERS if integer else _INTEGERS + _FLOATS):
        wanted = "an integer" if integer else "a number"
        return f"{value!r}, stored as {entry['type']} where {wanted} belongs"
    if kind == "id":
        return None if value >= 0 else f"{value}, a negative token id"
    if kind == "scale":
        return None if math.isfinite(value) and value >= 0 else f"{value!r}; it must be 0 or above"
    if not (math.isfinite(value) and value > 0):
        return f"{value!r}; it must be above 0"
    return None
