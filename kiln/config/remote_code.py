"""Kiln runs no code from checkpoints (its own model classes only, kiln/model/registry.py).

transformers is told so on every load (`trust_remote_code=False`): left at its default (None),
a config or tokenizer naming its own code (`auto_map`) made transformers ask on stdin "Do you
wish to run the custom code? [y/N]", blocking start-up, and a "y" ran the checkpoint's Python.
Its refusal then advises `trust_remote_code=True`, which Kiln accepts and ignores, so the
advice is replaced by what is true here.
"""

# transformers' refusal names this argument; only that refusal does.
_MARKER = "trust_remote_code"


def needs_checkpoint_code(error: BaseException) -> bool:
    """Whether transformers refused because the files need their own code."""
    return isinstance(error, ValueError) and _MARKER in str(error)


def checkpoint_code_message(path, what: str) -> str:
    """Why a `what` ("model config", "tokenizer") that needs its own code is refused."""
    return (f"the {what} at {path} needs the checkpoint's own Python code (auto_map), and Kiln "
            "runs no code from checkpoints (--trust-remote-code is accepted for vLLM "
            "compatibility and changes nothing)")
