"""The OpenAI-compatible server (`kiln serve`): the app and its routes, request and response
models, one handler per route, metrics and OpenAI-style error bodies."""
