"""The `kiln` command: generate, chat, serve, compile and bench, with vLLM's engine flags."""
