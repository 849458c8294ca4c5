"""The OpenAI-compatible HTTP server: a FastAPI app around one AsyncLLM, run by uvicorn
(server_lifecycle.py: serve(), its stop signals and exit code).
"""
import contextlib

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kiln import envs
from kiln.engine.async_llm import AsyncLLM
from kiln.engine.text_encoding import encode_text
from kiln.entrypoints.openai.errors import install_error_handlers
from kiln.entrypoints.openai.json_body import JSONBodyRoute
from kiln.entrypoints.openai.metrics import ServerMetrics
from kiln.entrypoints.openai.middleware import (
    ApiKeyMiddleware,
    BodySizeLimitMiddleware,
    RequestIdHeaderMiddleware,
    ServerLoadMiddleware,
    ShutdownGate,
)
from kiln.entrypoints.openai.openapi import describe
from kiln.entrypoints.openai.pooling_prompts import ChatSettings
from kiln.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kiln.entrypoints.openai.request_defaults import RequestDefaults
from kiln.entrypoints.openai.responses_protocol import ResponsesRequest
from kiln.entrypoints.openai.server_settings import ServerSettings
from kiln.entrypoints.openai.serving_chat import ServingChat
from kiln.entrypoints.openai.serving_completion import ServingCompletion
from kiln.entrypoints.openai.serving_embedding import (
    EmbeddingRequest,
    PoolingRequest,
    ServingEmbedding,
    refuse_generate,
)
from kiln.entrypoints.openai.serving_models import ServingModels, displayable
from kiln.entrypoints.openai.serving_responses import ServingResponses
from kiln.entrypoints.openai.serving_score import add_score_routes
from kiln.entrypoints.openai.serving_tokenization import ServingTokenization
from kiln.logger import init_logger
from kiln.lora.serving import add_lora_routes, checked_lora_requests
from kiln.worker.host_memory import freeze_gc_heap

logger = init_logger(__name__)

def build_app(llm: AsyncLLM, settings: ServerSettings) -> FastAPI:
    from kiln.model.loader.default_model import model_display_name

    model_config = llm.kiln_config.model_config
    name = displayable(model_display_name(str(model_config.model)))
    models = ServingModels(settings.served_model_names or [name], name, llm.max_model_len,
                           checked_lora_requests(llm, settings.lora_modules))
    llm.max_sequences_per_request = settings.max_sequences_per_request
    cache = llm.kiln_config.cache_config
    metrics = ServerMetrics(models.default_name, log_interval=settings.stats_log_interval,
                            cache_info={
                                "block_size": cache.block_size,
                                "num_gpu_blocks": llm.num_blocks,
                                "enable_prefix_caching": cache.enable_prefix_caching,
                                "kv_cache_memory": cache.kv_cache_memory,
                                "gpu_memory_utilization": cache.gpu_memory_utilization,
                                "cache_dtype": cache.cache_dtype},  # vLLM's label: fp8 or not
                            max_lora=getattr(getattr(llm.kiln_config, "lora_config", None),
                                             "max_loras", None),
                            num_engines=llm.kiln_config.parallel_config.data_parallel_size)
    llm.stat_loggers.append(metrics)
    defaults = RequestDefaults(settings.default_chat_template_kwargs,
                               settings.return_tokens_as_token_ids,
                               settings.enable_force_include_usage)
    completion = ServingCompletion(llm, models, settings.enable_prompt_tokens_details,
                                   settings.disable_any_whitespace,
                                   reasoning_parser=settings.reasoning_parser,
                                   defaults=defaults)
    chat = ServingChat(llm, models, settings.enable_prompt_tokens_details,
                       tool_call_parser=settings.tool_call_parser,
                       enable_auto_tool_choice=settings.enable_auto_tool_choice,
                       reasoning_parser=settings.reasoning_parser,
                       disable_any_whitespace=settings.disable_any_whitespace,
                       trust_request_chat_template=settings.trust_request_chat_template,
                       defaults=defaults)
    responses = ServingResponses(chat)
    pooling_chat = ChatSettings(settings.trust_request_chat_template, defaults)
    embedding = ServingEmbedding(llm, models, pooling_chat)
    pooling = embedding.pooling  # --runner pooling: the generate endpoints refuse (vLLM's)
    tokenization = ServingTokenization(llm, models, model_config.vocab_size,
                                       settings.trust_request_chat_template, defaults)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        llm.start()
        tokenization.start()
        # The start-up heap (torch, the tokenizer, the app) lives as long as the server: left
        # tracked, each full collection rescanned it on the event loop, and every stream waited
        # (docs/architecture.md has the figures).
        freeze_gc_heap(collect=True)
        yield
        await responses.background.close()  # cancelled, each stored with what it wrote
        logger.info("shutting down: aborting %d in-flight request(s)", llm.num_in_flight)
        await llm.drain_and_shutdown()
        if metrics.stats_log is not None:
            metrics.stats_log.flush(stopped=True)  # the last line says the engine drained
        tokenization.close()

    # --disable-fastapi-docs (vLLM's): no /openapi.json, /docs, /docs/oauth2-redirect, /redoc
    docs = {} if not settings.disable_fastapi_docs else dict(openapi_url=None, docs_url=None,
                                                              redoc_url=None)
    app = FastAPI(title="Kiln OpenAI-compatible server", lifespan=lifespan, **docs)
    # --root-path, set as vLLM sets it (app.root_path; FastAPI's keyword for it is deprecated):
    # routes answer under the prefix too, and the OpenAPI schema and docs pages name it
    app.root_path = settings.root_path
    app.router.route_class = JSONBodyRoute  # every route below parses its body with jiter
    app.state.llm = llm
    app.state.metrics = metrics
    app.state.models = models
    app.state.background_responses = responses.background  # the grace period waits for them
    install_error_handlers(app)
    tokenizer = llm.tokenizer
    open_paths = None  # every route takes the key but these (no key: none does)
    if settings.api_key:
        open_paths = ("/health", "/ping", "/metrics") if settings.metrics_public \
            else ("/health", "/ping")
    describe(app, vocab_size=model_config.vocab_size,
             empty_text_has_tokens=tokenizer is not None
             and bool(encode_text(tokenizer, "", add_special_tokens=True)),
             reasoning_parser=settings.reasoning_parser is not None,
             max_model_len=model_config.max_model_len, open_paths=open_paths,
             request_chat_template=settings.trust_request_chat_template,
             max_logprobs=model_config.logprobs_cap,
             responses_store=responses.store.enabled,
             max_sequences=settings.max_sequences_per_request)

    @app.get("/health", response_class=Response, responses={
        200: {"description": "The engine is running", "content": {}},
        503: {"description": "The engine died or is shutting down", "content": {}}})
    async def health() -> Response:
        return Response(status_code=200 if llm.is_running else 503)

    # HEAD too (some load balancers probe with it), outside the schema: one operation id each
    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)
    # vLLM's /ping, the probe SageMaker sends (GET or POST): /health under another name.
    # operation_id: FastAPI's own names the route by the first of its methods, a set whose
    # order follows PYTHONHASHSEED, so the ids changed from one start to the next.
    app.add_api_route("/ping", health, methods=["GET", "POST"], name="health_ping",
                      operation_id="health_ping",
                      response_class=Response, responses={
                          200: {"description": "The engine is running", "content": {}},
                          503: {"description": "The engine died or is shutting down",
                                "content": {}}})
    server_load = ServerLoadMiddleware.Counter()

    @app.get("/load")
    async def load():
        """vLLM's load report: the completion, chat and responses requests in flight (a stream until its
        last byte), for a load balancer that routes to the least busy server."""
        return {"server_load": server_load.value}

    @app.get("/version")
    async def version():
        from kiln.version import __version__
        return {"version": __version__}

    @app.get("/v1/models")
    async def list_models():
        return JSONResponse(models.list_models().model_dump())

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw: Request):
        if pooling:
            raise refuse_generate("Completions", model_config.architecture)
        return await completion.create(req, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request):
        if pooling:
            raise refuse_generate("Chat Completions", model_config.architecture)
        return await chat.create(req, raw)

    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, raw: Request):
        if pooling:
            raise refuse_generate("Responses", model_config.architecture)
        return await responses.create(req, raw)

    # The store's (KILN_ENABLE_RESPONSES_API_STORE; 404 without it): GET as vLLM's (stream=true
    # replays a streamed background response's events), DELETE as OpenAI's. One route, so that
    # a 405 lists both methods in its Allow header.
    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    async def stored_response(response_id: str, raw: Request, stream: bool = False,
                              starting_after: int | None = None):
        if raw.method == "DELETE":
            return JSONResponse(responses.store.delete(response_id))
        if stream or starting_after is not None:
            return StreamingResponse(
                responses.background.replay(response_id, stream, starting_after),
                media_type="text/event-stream")
        return JSONResponse(responses.store.get(response_id))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        return JSONResponse(await responses.background.cancel(response_id))

    # Each runner's schema states the endpoints it serves; the others answer their refusal.
    @app.post("/v1/embeddings", include_in_schema=embedding.task == "embed")
    async def create_embedding(req: EmbeddingRequest, raw: Request):
        return await embedding.create(req, raw)

    @app.post("/pooling", include_in_schema=pooling)
    async def create_pooling(req: PoolingRequest, raw: Request):
        return await embedding.pooling_create(req, raw)

    add_score_routes(app, llm, models, pooling_chat)

    if pooling:
        for route in app.routes:
            if getattr(route, "path", None) in ("/v1/completions", "/v1/chat/completions",
                                                "/v1/responses", "/v1/responses/{response_id}",
                                                "/v1/responses/{response_id}/cancel"):
                route.include_in_schema = False

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        # The body comes encoded from a front-end thread (serving_tokenization.py).
        return Response(await tokenization.tokenize(req), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        return JSONResponse((await tokenization.detokenize(req)).model_dump())

    @app.get("/metrics", response_class=Response, responses={200: {
        "description": "Prometheus text exposition",
        "content": {metrics.content_type.split(";")[0]: {"schema": {"type": "string"}}}}})
    async def prometheus_metrics() -> Response:
        if llm.is_running:
            metrics.update_gauges(await llm.get_stats())
        return Response(metrics.render(), media_type=metrics.content_type)

    if envs.allow_runtime_lora_updating():
        add_lora_routes(app, llm, models)
    if envs.server_dev_mode():
        from kiln.entrypoints.openai.dev_routes import add_dev_routes
        add_dev_routes(app, llm)

    # Outermost first: auth refuses before the body is read; the size limit guards the rest.
    app.state.shutdown_gate = ShutdownGate()
    app.add_middleware(ServerLoadMiddleware, counter=server_load)  # innermost: past the key
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_body_bytes,
                       read_timeout=settings.request_body_timeout,
                       gate=app.state.shutdown_gate)
    if open_paths is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key, open_paths=open_paths,
                           body_bytes=settings.max_request_body_bytes,
                           body_timeout=settings.request_body_timeout)
    app.add_middleware(RequestIdHeaderMiddleware, always=settings.enable_request_id_headers)
    # Outermost: a browser's preflight (OPTIONS, no key) is answered here.
    app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins,
                       allow_methods=settings.allowed_methods,
                       allow_headers=settings.allowed_headers,
                       allow_credentials=settings.allow_credentials)
    return app
