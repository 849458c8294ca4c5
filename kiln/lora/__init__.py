"""Multi-LoRA serving as vLLM does it: PEFT adapters applied per token by slot (punica-style),
stacked in max_loras slots loaded and evicted LRU (kiln/lora/)."""
