"""Warm-up vs serving, per engine: compiling is allowed only while an engine warms up.

Each engine's phase lives in its model runner's CompileState (compile_state.py), so two engines
in one process (a benchmark comparing modes, a test) keep their own; the worker ends it once
every shape is compiled, and a compile after that is a bug.
"""


class RecompileAfterWarmupError(RuntimeError):
    """Something asked for a (re)compile after warm-up ended; the message names the cause."""


class WarmupPhase:
    """Whether one engine has finished warming up."""

    def __init__(self):
        self.serving = False

    def __repr__(self) -> str:
        return f"WarmupPhase(serving={self.serving})"

    def end(self) -> None:
        """Warm-up is over: from now on every compile raises RecompileAfterWarmupError."""
        self.serving = True

    def reset(self) -> None:
        """Back to warm-up (a new model built under this config compiles on its first call)."""
        self.serving = False

    def check_may_compile(self, what: str) -> None:
        if self.serving:
            raise RecompileAfterWarmupError(
                f"{what} after warm-up ended (the worker compiles every shape before serving): "
                "add the size to compilation_config.compile_sizes / stay within "
                "max_num_batched_tokens, or run with enforce_eager=True.")
