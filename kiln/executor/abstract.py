"""The executor interface the engine core talks to, whatever runs the workers behind it.

Uniproc runs one worker in-process; multiprocess and Ray executors fan the same calls out.
"""
from abc import ABC, abstractmethod

from kiln.core.outputs import ModelRunnerOutput, SchedulerOutput
from kiln.lora.load_failure import raise_rank_failure


class Executor(ABC):
    def __init__(self, kiln_config):
        self.kiln_config = kiln_config

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """KV cache blocks every worker can hold (the minimum over workers)."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int, max_model_len: int | None = None) -> None:
        """Allocate `num_blocks` KV blocks on every worker; `max_model_len`: the engine's (the
        KV cache may have capped it), which the models' longrope factors follow."""

    @abstractmethod
    def compile_or_warm_up_model(self) -> None:
        """Compile / warm up every shape the engine will run (and capture graphs)."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; returns the (driver) worker's sampled tokens."""

    @abstractmethod
    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        """vLLM's: every worker's `method` (a Worker method's name, or a callable taking the
        worker first) with `args` / `kwargs`; the results in rank order."""

    def comm_stats(self) -> dict | None:
        """Per-rank time in collectives and in delivering each step's scheduler output since
        the last reset (None: one rank, nothing to measure)."""
        return None

    def reset_comm_stats(self) -> None:
        """Start measuring comm_stats afresh (after warm-up, before a benchmark's timed run)."""
        return None

    def compile_stats(self) -> list[dict] | None:
        """Each rank's compile state (kiln/compilation/monitor.py process_compile_state), for
        `kiln compile`: its ranks compile in their own processes. None: the model runs in
        this process, whose state the caller reads itself."""
        return None

    def rank_sentinels(self) -> list[int]:
        """File descriptors that become readable when a rank dies, for a caller that waits
        between steps and must not miss a death there (empty: no rank of its own to watch)."""
        return []

    # Seconds between `check_health` calls while the engine is idle, for ranks that have no
    # sentinel to wait on (Ray actors, perhaps on other machines); None: not needed.
    idle_check_s: float | None = None

    def check_health(self) -> None:
        """Raise WorkerFailedError naming a rank that died between steps (a step finds one that
        dies during it); called where `rank_sentinels` woke the caller, and every
        `idle_check_s` while idle. Never blocks."""
        return None

    @abstractmethod
    def shutdown(self) -> None:
        """Release workers and their resources; safe to call twice."""


class RankFanOutExecutor(Executor):
    """An executor whose ranks run in processes of their own (multiproc, Ray): every call goes
    to all ranks through `_run_on_all`, which also times the scheduler outputs it delivers
    (`broadcast_seconds`, `broadcast_calls`, set by the subclass with `world_size`)."""

    @abstractmethod
    def _run_on_all(self, method: str, *args) -> list:
        """Call the rank workers' `method` on every rank; their replies, in rank order."""

    def determine_num_blocks(self) -> int:
        return min(self._run_on_all("determine_num_blocks"))

    def initialize_cache(self, num_blocks: int, max_model_len: int | None = None) -> None:
        self._run_on_all("initialize_cache", num_blocks, max_model_len)

    def compile_or_warm_up_model(self) -> None:
        self._run_on_all("compile_or_warm_up_model")

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        from kiln.core.rpc_wire import raise_failures

        return raise_failures(self._run_on_all("collective_rpc", method, tuple(args), kwargs))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        replies = self._run_on_all("execute_model", scheduler_output)
        raise_rank_failure(replies)  # an adapter the ranks could not read (kiln/lora/)
        return next(r for r in replies if r is not None)

    def comm_stats(self) -> dict:
        per_rank = self._run_on_all("comm_stats")
        return {"world_size": self.world_size,
                "scheduler_output_broadcast_s": self.broadcast_seconds,
                "scheduler_output_broadcasts": self.broadcast_calls, "ranks": per_rank}

    def compile_stats(self) -> list[dict]:
        return self._run_on_all("compile_stats")

    def reset_comm_stats(self) -> None:
        self._run_on_all("reset_comm_stats")
        self.broadcast_seconds, self.broadcast_calls = 0.0, 0
