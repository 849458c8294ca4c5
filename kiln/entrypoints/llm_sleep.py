"""`LLMSleepMode`: vLLM's LLM.sleep / wake_up / is_sleeping and collective_rpc (the RL hooks
verl, OpenRLHF and TRL call), each between batches; kiln/engine/engine_sleep.py does the work."""


class LLMSleepMode:
    """Mixed into `LLM` (llm.py): its engine and one-batch lock."""

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Free the KV cache (level 1; the weights stay, in host memory on CUDA) and discard
        the weights too (level 2), or only pause scheduling (level 0); the prefix cache is
        reset. Needs LLM(enable_sleep_mode=True) for levels 1 and 2. generate() refuses until
        wake_up()."""
        self._check_owner()
        with self._one_batch("sleep"):
            self.llm_engine.sleep(level, mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back the memory `tags` name ("weights", "kv_cache"; "scheduling" after level
        0; None: all). After sleep(level=2), load the weights before generating:
        collective_rpc("reload_weights") or collective_rpc("load_weights", kwargs={"weights":
        [(name, tensor), ...]})."""
        self._check_owner()
        with self._one_batch("wake_up"):
            self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        self._check_owner()
        with self._one_batch("is_sleeping"):
            return self.llm_engine.is_sleeping()

    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """Run `method` on every worker (a Worker method's name: "load_weights" takes
        `weights`, HF-named (name, tensor) pairs, written in place, each rank taking its shard,
        into the target or, with `model="draft"`, a speculative draft model / EAGLE head;
        "reload_weights" reads the checkpoints again (both, or `model`'s); or a callable `f(worker, *args,
        **kwargs)`, a module-level function where the engine runs in its own process); returns
        the workers' results in rank order. `timeout` (seconds): a call still running then
        raises TimeoutError naming it (vLLM's); it runs on, and the engine waits for it."""
        self._check_owner()
        with self._one_batch("collective_rpc"):
            return self.llm_engine.collective_rpc(method, timeout, args, kwargs)
