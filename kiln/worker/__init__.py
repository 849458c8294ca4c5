"""The worker side of the executor: `Worker` (device, model, KV cache sizing, warm-up, sleep mode,
weight updates) and `ModelRunner` (a step's inputs, forward and sampling)."""
