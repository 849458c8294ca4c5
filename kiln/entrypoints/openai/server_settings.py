"""The server's settings (`kiln serve`'s own flags) and their defaults: light, so the CLI builds
its parser without importing FastAPI and the engine.
"""
from dataclasses import dataclass, field

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 256


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_names: list[str] | None = None  # None: the --model value
    # --lora-modules: {"name", "path", "base_model_name"} each (kiln/lora/serving.py)
    lora_modules: list[dict] | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    # A request's prompts x n: more is a 400 naming --max-sequences-per-request.
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST
    metrics_public: bool = False  # /metrics without the API key (for a Prometheus scraper)
    # A client that sends no complete request headers (or no body data) for this long is cut.
    request_header_timeout: float = 10.0
    request_body_timeout: float = 30.0
    # A client that reads nothing of a full send buffer for this long is dropped, which aborts
    # its request (nginx's send_timeout).
    response_send_timeout: float = 60.0
    graceful_shutdown_timeout: float = 5.0  # seconds in-flight requests get on SIGTERM
    timeout_keep_alive: float = 5.0  # seconds an idle connection stays open (KILN_HTTP_...)
    access_log: bool = True
    log_level: str = "info"
    # usage.prompt_tokens_details.cached_tokens in responses (vLLM's flag of the same name).
    enable_prompt_tokens_details: bool = False
    # Chat answers (vLLM's flags): tool calls read by this parser when tool_choice is "auto"
    # (which needs enable_auto_tool_choice); thinking text split off by the reasoning parser.
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    # Structured outputs without free whitespace unless a request asks for it
    # (--structured-outputs-config '{"disable_any_whitespace": true}').
    disable_any_whitespace: bool = False
    # A request's own chat_template (Jinja text) renders its chat; off, such a request is a 400.
    trust_request_chat_template: bool = False
    # CORS (vLLM's flags and defaults): browsers on any origin may call the API; the key, where
    # one is set, still guards every route.
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    # vLLM's: template variables under each chat's chat_template_kwargs (the request's win),
    # return_tokens_as_token_ids where a request leaves it unset, and usage at the end of
    # every stream (as stream_options.include_usage); see request_defaults.py.
    default_chat_template_kwargs: dict = field(default_factory=dict)
    return_tokens_as_token_ids: bool = False
    enable_force_include_usage: bool = False
    disable_fastapi_docs: bool = False  # no /openapi.json, /docs, /redoc
    # X-Request-Id on every response: a new one where the request sent none (the client's own
    # is always echoed)
    enable_request_id_headers: bool = False
    # Seconds between throughput lines in the log while busy; None: none (--disable-log-stats).
    stats_log_interval: float | None = 5.0
    # vLLM's --root-path: the path prefix a proxy serves this app under (FastAPI's root_path)
    root_path: str = ""
    # vLLM's HTTPS flags (server_tls.py); no certificate: plain HTTP
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0  # ssl.CERT_NONE: no client certificate asked
