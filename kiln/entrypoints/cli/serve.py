"""`kiln serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) on one engine.

Takes every engine flag of `kiln generate`, plus the server's own (host, port, key, limits).
"""
import argparse
import json
import os
import socket
import sys

from kiln.engine.arg_utils import EngineArgs
from kiln.entrypoints.cli.serve_banner import banner
from kiln.envs import api_key as env_api_key
from kiln.envs import http_timeout_keep_alive_s

TOOL_CALL_PARSER_NAMES = ["granite", "hermes", "internlm", "llama3_json", "mistral", "pythonic",
                          "qwen3_coder"]
REASONING_PARSER_NAMES = ["deepseek_r1", "qwen3"]


def _json_strings(flag: str):
    """An argparse type: a JSON list of strings (vLLM's form, '["https://a.example"]')."""
    def parse(text: str) -> list[str]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise argparse.ArgumentTypeError(f"{flag} takes a JSON list of strings, e.g. "
                                             f"'[\"*\"]', got {text!r}")
        return value
    return parse


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from kiln.entrypoints.openai.server_settings import (
        DEFAULT_MAX_REQUEST_BODY_BYTES,
        DEFAULT_MAX_SEQUENCES_PER_REQUEST,
    )
    from kiln.lora.serving import lora_module_flag

    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health and "
                        "/ping (default: $KILN_API_KEY, else $VLLM_API_KEY)")
    g.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without the API key (for a Prometheus scraper)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use (default: the --model value)")
    g.add_argument("--lora-modules", nargs="+", default=None, type=lora_module_flag,
                   metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) served by name, as vLLM's: "
                        "name=path or '{\"name\": ..., \"path\": ..., "
                        "\"base_model_name\": ...}'; needs --enable-lora")
    g.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="refuse larger request bodies with HTTP 413")
    g.add_argument("--max-sequences-per-request", type=int,
                   default=DEFAULT_MAX_SEQUENCES_PER_REQUEST,
                   help="refuse a request whose prompts x n is larger (HTTP 400)")
    g.add_argument("--request-header-timeout", type=float, default=10.0,
                   help="seconds a client has to send complete request headers")
    g.add_argument("--request-body-timeout", type=float, default=30.0,
                   help="seconds a request body may pause before the request gets HTTP 408")
    g.add_argument("--response-send-timeout", type=float, default=60.0,
                   help="seconds a client may read nothing while the server's send buffer to "
                        "it is full; then the connection is dropped and its request aborted")
    for flag, what in (("--allowed-origins", "origins"), ("--allowed-methods", "methods"),
                       ("--allowed-headers", "request headers")):
        g.add_argument(flag, type=_json_strings(flag), default=["*"],
                       help=f"CORS: the {what} browsers may use, a JSON list (vLLM's flag)")
    g.add_argument("--allow-credentials", action="store_true",
                   help="CORS: let browsers send cookies and HTTP auth with cross-origin calls")
    g.add_argument("--frontend-niceness", type=int, default=None,
                   help="once the engine core runs in its own process, lower this server "
                        "process's CPU priority by this much (0: not at all), so steps wait "
                        "less for front-end work on shared cores (default: 0 where the core "
                        "leaves this process a core, KILN_CPU_NUM_OF_RESERVED_CPU; else 5)")
    g.add_argument("--graceful-shutdown-timeout", type=float, default=5.0,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM")
    # vLLM's name for it too: `vllm serve ... --disable-uvicorn-access-log` scripts carry over
    g.add_argument("--disable-access-log", "--disable-uvicorn-access-log", action="store_true",
                   help="do not log one line per HTTP request")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens (prompt tokens the "
                        "prefix cache held)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's own log level (HTTP server messages)")
    # The parsers' registries (tool_parsers.TOOL_PARSERS, reasoning.REASONING_PARSERS) import
    # the server's models; the CLI names them without that cost (a test keeps them equal).
    g.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSER_NAMES,
                   help="how tool calls are read from chat and /v1/responses answers "
                        "(tool_choice auto)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model choose to call tools (tool_choice auto); needs "
                        "--tool-call-parser")
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSER_NAMES,
                   help="split thinking (<think>...</think>) into reasoning_content")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat with the request's own chat_template when it gives one "
                        "(Jinja in transformers' sandbox; off, such requests get HTTP 400)")
    g.add_argument("--structured-outputs-config", default=None,
                   help="JSON, e.g. '{\"disable_any_whitespace\": true}': structured outputs "
                        "without free whitespace unless a request sets it")
    g.add_argument("--default-chat-template-kwargs", default=None,
                   help="JSON object of chat template variables every chat gets under its own "
                        "chat_template_kwargs (the request's keys win), e.g. "
                        "'{\"enable_thinking\": false}'")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprob tokens as 'token_id:<id>' where a request leaves "
                        "return_tokens_as_token_ids unset")
    g.add_argument("--enable-force-include-usage", action="store_true",
                   help="end every stream with its usage chunk, as if stream_options "
                        "include_usage were set")
    g.add_argument("--disable-fastapi-docs", action="store_true",
                   help="serve no OpenAPI schema (/openapi.json) and no /docs or /redoc pages")
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help="send X-Request-Id on every response: a new id where the request "
                        "sent none (a client's own X-Request-Id is always echoed)")
    g.add_argument("--root-path", default="",
                   help="the path prefix a reverse proxy serves this server under (FastAPI's "
                        "root_path, as vLLM's): routes answer with and without it")
    g.add_argument("--ssl-keyfile", default=None, help="HTTPS: the server's private key file")
    g.add_argument("--ssl-certfile", default=None,
                   help="HTTPS: the server's certificate file (with it, kiln serve speaks HTTPS)")
    g.add_argument("--ssl-ca-certs", default=None,
                   help="HTTPS: CA certificates that client certificates are checked against")
    g.add_argument("--ssl-cert-reqs", type=int, default=0,
                   help="HTTPS: whether a client certificate is required (Python's ssl module: "
                        "0 none, 1 optional, 2 required)")
    # vLLM's flag, taken so that vLLM command lines carry over
    g.add_argument("--max-log-len", default=None, metavar="N",
                   help="accepted for vLLM command lines: Kiln never logs prompts, so there "
                        "is nothing to shorten")
    return parser


def settings_from_args(args: argparse.Namespace):
    from kiln.entrypoints.openai.server_settings import ServerSettings

    if args.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be >= 1, got "
                         f"{args.max_request_body_bytes}")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                         f"{', '.join(TOOL_CALL_PARSER_NAMES)})")
    from kiln.entrypoints.openai.request_defaults import parse_default_chat_template_kwargs
    from kiln.entrypoints.openai.serving_models import check_served_names
    from kiln.entrypoints.openai.structured_fields import parse_structured_outputs_config

    no_whitespace = parse_structured_outputs_config(args.structured_outputs_config)
    template_kwargs = parse_default_chat_template_kwargs(args.default_chat_template_kwargs)
    if args.frontend_niceness is not None and not 0 <= args.frontend_niceness <= 19:
        raise ValueError(f"--frontend-niceness must be in 0..19, got {args.frontend_niceness}")
    if args.max_sequences_per_request < 1:
        raise ValueError(f"--max-sequences-per-request must be >= 1, got "
                         f"{args.max_sequences_per_request}")
    for flag in ("request_header_timeout", "request_body_timeout", "response_send_timeout"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0 seconds, got "
                             f"{getattr(args, flag)}")
    if not 0 <= args.graceful_shutdown_timeout < float("inf"):  # NaN failed only at shutdown
        raise ValueError(f"--graceful-shutdown-timeout must be a finite number of seconds >= 0 "
                         f"(0: abort requests in flight at once), got "
                         f"{args.graceful_shutdown_timeout}")
    if args.served_model_name is not None and not all(n.strip() for n in args.served_model_name):
        raise ValueError(f"--served-model-name must not be empty, got {args.served_model_name}")
    check_served_names(args.served_model_name or [])  # before the model loads
    if args.lora_modules and not getattr(args, "enable_lora", False):
        raise ValueError("--lora-modules needs --enable-lora")
    api_key = args.api_key or env_api_key()
    if api_key is not None and api_key != api_key.strip():
        # HTTP strips a header value's outer whitespace: no client could ever send this key.
        raise ValueError("the API key (--api-key, else $KILN_API_KEY or $VLLM_API_KEY) begins "
                         "or ends with whitespace, which no Authorization header can carry; "
                         "set it without")
    from kiln.entrypoints.openai.server_tls import check_tls_flags

    check_tls_flags(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.ssl_cert_reqs)
    if args.root_path and (not args.root_path.startswith("/") or args.root_path.endswith("/")):
        raise ValueError(f"--root-path must start with / and not end with one (e.g. /api), got "
                         f"{args.root_path!r}")
    return ServerSettings(host=args.host, port=args.port, api_key=api_key,
                          root_path=args.root_path, ssl_keyfile=args.ssl_keyfile,
                          ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                          ssl_cert_reqs=args.ssl_cert_reqs,
                          served_model_names=args.served_model_name,
                          lora_modules=args.lora_modules,
                          max_request_body_bytes=args.max_request_body_bytes,
                          max_sequences_per_request=args.max_sequences_per_request,
                          metrics_public=args.metrics_public,
                          request_header_timeout=args.request_header_timeout,
                          request_body_timeout=args.request_body_timeout,
                          allowed_origins=args.allowed_origins,
                          allowed_methods=args.allowed_methods,
                          allowed_headers=args.allowed_headers,
                          allow_credentials=args.allow_credentials,
                          response_send_timeout=args.response_send_timeout,
                          graceful_shutdown_timeout=args.graceful_shutdown_timeout,
                          access_log=not args.disable_access_log,
                          log_level=args.uvicorn_log_level,
                          enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                          tool_call_parser=args.tool_call_parser,
                          enable_auto_tool_choice=args.enable_auto_tool_choice,
                          reasoning_parser=args.reasoning_parser,
                          disable_any_whitespace=no_whitespace,
                          trust_request_chat_template=args.trust_request_chat_template,
                          default_chat_template_kwargs=template_kwargs,
                          return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                          enable_force_include_usage=args.enable_force_include_usage,
                          disable_fastapi_docs=args.disable_fastapi_docs,
                          enable_request_id_headers=args.enable_request_id_headers,
                          stats_log_interval=None if args.disable_log_stats else 5.0,
                          timeout_keep_alive=http_timeout_keep_alive_s())


def register(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve the OpenAI HTTP API",
                                   description="Serve a model over the OpenAI-compatible HTTP "
                                               "API (completions, chat, models, metrics).")
    parser.add_argument("model_tag", nargs="?", default=None,
                        help="the model (same as --model)")
    add_server_args(parser)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kiln.engine.async_llm import AsyncLLM
    from kiln.entrypoints.openai.server_lifecycle import serve
    from kiln.process_signals import stopped_by

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    settings = settings_from_args(args)  # cheap checks before the model loads
    sock = bind_socket(settings.host, settings.port)  # a port in use: said now, not after
    try:
        llm = AsyncLLM.from_engine_args(EngineArgs.from_cli_args(args))
        if llm.core_pid != os.getpid():  # the core keeps its priority; only we yield
            from kiln.engine.frontend_lanes import frontend_niceness, lower_front_end

            lower_front_end(frontend_niceness(args.frontend_niceness, llm.num_threads))
        print(banner(llm, settings), file=sys.stderr, flush=True)
        return serve(llm, settings, sock, stop_signal=stopped_by)
    finally:
        sock.close()


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads (uvicorn serves on it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}): the port is in use "
                         "or the address is not this machine's; pick another with --port or "
                         "--host") from None
    return sock
