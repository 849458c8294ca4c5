"""Which residual-stream rotation an engine runs (`quantization_rotation`): "auto" resolves to
"hadamard" where online int8 can take it, else "none"; "hadamard" asked for is refused where not.

The rotation itself (the matrix, the load-time transform) is kiln/model/residual_rotation.py.
"""
from typing import TYPE_CHECKING

from kiln.errors import ConfigError

if TYPE_CHECKING:
    from kiln.config.kiln_config import KilnConfig

CHOICES = ("auto", "hadamard", "none")
# methods that read nothing of the target but its tokens (EAGLE heads read its hidden states)
_TOKEN_ONLY_SPECULATION = ("ngram", "draft_model")


def requested_rotation(value) -> str:
    """The asked-for value checked: one of CHOICES, None taken as "none" (the field's value
    before "auto" was its default)."""
    if value is None:
        return "none"
    if value not in CHOICES:
        raise ConfigError(f"quantization_rotation (--quantization-rotation) must be one of "
                          f"{', '.join(CHOICES)}, got {value!r}")
    return value


def rotation_blocker(quantization: str | None, architecture: str, runner_type: str = "generate",
                     pipeline_parallel_size: int = 1, lora: bool = False,
                     speculative_method: str | None = None) -> tuple[str, str] | None:
    """Why the rotation cannot run on this engine, as (the fact, for auto's log line; what an
    explicit --quantization-rotation is refused with, after the flag), or None where it can."""
    from kiln.model.residual_rotation import ROTATABLE_ARCHITECTURES

    if quantization != "int8":
        return (f"quantization={quantization!r}",
                f"rotates weights before online int8 quantization; it needs --quantization "
                f"int8 (got quantization={quantization!r}); add --quantization int8 or drop "
                f"the flag")
    if architecture not in ROTATABLE_ARCHITECTURES:
        return (f"{architecture} (only {', '.join(ROTATABLE_ARCHITECTURES)})",
                f"{architecture} is not supported (only {', '.join(ROTATABLE_ARCHITECTURES)}); "
                f"drop the flag")
    # (-tp splits no rotation: every rank's shards hold the hidden dimension whole)
    if pipeline_parallel_size != 1:
        return (f"pipeline_parallel_size={pipeline_parallel_size}",
                "runs on one pipeline stage only (the first stage rotates the stream, the "
                f"last un-rotates it); drop it or use -pp 1 (got -pp {pipeline_parallel_size})")
    if runner_type != "generate":
        return (f"runner={runner_type!r}",
                f"the {runner_type} runner reads the final hidden states, which stay rotated "
                "(only the LM head's input is rotated back); drop the flag")
    if lora:
        return ("--enable-lora",
                "LoRA adapters are trained on the unrotated layers; drop --enable-lora or the "
                "flag")
    if speculative_method is not None and speculative_method not in _TOKEN_ONLY_SPECULATION:
        return (f"speculative_config.method={speculative_method!r}",
                f"speculative_config.method={speculative_method!r} reads the target's hidden "
                "states, which the rotation changes; use 'ngram' or 'draft_model', or drop the "
                "flag")
    return None


def resolve_rotation(requested: str, blocker: tuple[str, str] | None) -> str:
    """The rotation that runs: "hadamard" or "none", never "auto"; an explicit "hadamard" that
    cannot run is refused, naming the flag and the fix."""
    if requested == "none":
        return "none"
    if blocker is None:
        return "hadamard"
    if requested == "hadamard":
        raise ConfigError(f"--quantization-rotation hadamard: {blocker[1]}")
    return "none"


def resolve_quantization_rotation(config: "KilnConfig") -> None:
    """KilnConfig's step: set model_config.quantization_rotation from what was asked (kept in
    requested_rotation, so a config resolved again decides again), saying why where auto leaves
    online int8 unrotated."""
    m, p = config.model_config, config.parallel_config
    spec = config.speculative_config
    blocker = rotation_blocker(m.quantization, m.architecture, m.runner_type,
                               p.pipeline_parallel_size, config.lora_config is not None,
                               None if spec is None else spec.method)
    m.quantization_rotation = resolve_rotation(m.requested_rotation, blocker)
    if m.requested_rotation == "auto" and m.quantization == "int8" and blocker is not None:
        from kiln.logger import init_logger

        init_logger(__name__).info(
            "--quantization-rotation auto: online int8 runs unrotated (%s); its activations "
            "lose more to int8 than a rotated Llama model's", blocker[0])
