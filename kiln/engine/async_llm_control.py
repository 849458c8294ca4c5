"""`AsyncLLM`'s control calls (vLLM's EngineClient): the prefix cache reset, sleep mode and
collective_rpc, each on the engine thread between steps, once the engine is checked alive.
"""


class AsyncLLMControl:
    """Mixed into `AsyncLLM` (async_llm.py), whose `engine`, `_check_alive` and
    `_on_engine_thread` these methods use."""

    async def reset_prefix_cache(self, reset_running_requests: bool = False,
                                 reset_connector: bool = False) -> bool:
        """vLLM's AsyncLLM.reset_prefix_cache (after a weight update): forget every cached
        block; False while running requests hold blocks, unless `reset_running_requests` sends
        them back to the queue to be recomputed (their streams go on). Between steps."""
        self._check_alive()
        return await self._on_engine_thread(self.engine.reset_prefix_cache,
                                            bool(reset_running_requests), bool(reset_connector))

    # sleep mode (kiln/core/core_sleep.py) and collective_rpc
    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Between steps: requests in flight end ("abort", their streams finish with
        finish_reason "abort") or are recomputed after wake_up ("keep"); new ones wait."""
        self._check_alive()
        await self._on_engine_thread(self.engine.sleep, level, mode)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self._check_alive()
        await self._on_engine_thread(self.engine.wake_up, tags)

    async def is_sleeping(self) -> bool:
        self._check_alive()
        return await self._on_engine_thread(self.engine.is_sleeping)

    async def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None) -> list:
        self._check_alive()
        return await self._on_engine_thread(self.engine.collective_rpc, method, timeout, args,
                                            kwargs)
