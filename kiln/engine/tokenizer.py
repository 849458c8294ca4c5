"""Loads the tokenizer for a model: HF AutoTokenizer from a directory, or from a GGUF file.

For GGUF, transformers rebuilds the tokenizer and chat template from the file's metadata (once:
kiln/config/gguf_metadata.py keeps the result).
"""
from pathlib import Path

from kiln.config import gguf_metadata
from kiln.config.model_config import ModelConfig, find_gguf_file
from kiln.errors import ConfigError
from kiln.logger import init_logger

logger = init_logger(__name__)


def load_tokenizer(path: str | Path):
    """A HF tokenizer from a checkpoint directory, a tokenizer directory, or a .gguf file."""
    from transformers import AutoTokenizer

    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"tokenizer {str(path)!r}: no such file or directory; "
                                "pass a tokenizer directory or .gguf file with --tokenizer")
    gguf = find_gguf_file(path)
    if gguf is not None:
        return gguf_metadata.load_tokenizer(gguf)
    from kiln.config.remote_code import checkpoint_code_message, needs_checkpoint_code

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as e:
        if needs_checkpoint_code(e):
            raise ConfigError(f"{checkpoint_code_message(path, 'tokenizer')}; pass a tokenizer "
                              "that transformers loads by itself with --tokenizer") from None
        raise ConfigError(f"could not load a tokenizer from {str(path)!r} ({e}); "
                          "pass one with --tokenizer") from None


def get_tokenizer(model_config: ModelConfig):
    """The tokenizer a model config names (its own --tokenizer, else the checkpoint's, both
    resolved to local paths); None with skip_tokenizer_init."""
    if model_config.skip_tokenizer_init:
        return None
    return load_tokenizer(model_config.tokenizer_path)


def config_eos_token_ids(model_config: ModelConfig) -> set[int]:
    """The model config's eos ids: the end of sequence when there is no tokenizer to ask."""
    value = getattr(model_config.hf_config, "eos_token_id", None)
    if value is None:
        return set()
    return {int(v) for v in (value if isinstance(value, list) else [value])}


def generation_eos_token_ids(model_config: ModelConfig) -> set[int]:
    """Extra end-of-sequence ids from generation_config.json (chat models often list several).

    A checkpoint directory without one ends sequences at its config.json's eos_token_id, as HF
    generate and vLLM do (both build the generation config from the model config then): it
    used to run past it to max_tokens where that id is not the tokenizer's eos. A GGUF file's
    end of sequence is its tokenizer's (vLLM reads no generation config for one either)."""
    import json

    from kiln.config.generation_defaults import generation_config_file

    # --generation-config DIR names the file for the end tokens too, as in vLLM; "vllm" drops
    # only its sampling defaults
    source = model_config.generation_config
    path = generation_config_file("auto" if source == "vllm" else source, model_config.model_path)
    if path is None:
        return set() if model_config.gguf_file is not None else config_eos_token_ids(
            model_config)
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError):
        logger.warning("ignoring unreadable %s", path)
        return set()
    if value is None:
        return set()
    return {int(v) for v in (value if isinstance(value, list) else [value])}
