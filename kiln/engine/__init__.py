"""The engine front: input processing, detokenization and outputs, `LLMEngine` and `AsyncLLM`,
and the clients of the engine core (in its own process, in this one, or one per data-parallel
replica)."""
