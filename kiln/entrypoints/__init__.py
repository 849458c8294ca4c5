"""What users call: `LLM` (offline batches), the `kiln` command (cli/) and the OpenAI-compatible
HTTP server (openai/)."""
