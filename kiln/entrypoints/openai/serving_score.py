"""POST /score, /v1/score and /rerank, /v1/rerank, /v2/rerank (vLLM's bodies and responses,
Jina's and Cohere's rerank shape): a cross-encoder's score of each (text_1, text_2) pair, or an
embedding model's cosine similarity (kiln/pooling/scoring.py), 1:1, 1:N or N:N; rerank sorts
the documents by their score against the query."""
import time

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.pooling_requests import (
    field_error,
    pool,
    pooling_task,
    refuse_task,
    resolve_model,
)
from kiln.entrypoints.openai.pooling_responses import (
    RerankDocument,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreResponse,
    pooling_usage,
)
from kiln.entrypoints.openai.protocol_base import JsonInt
from kiln.entrypoints.openai.request_fields import response_id
from kiln.entrypoints.openai.serving_classify import ActivationFields, activation_params
from kiln.entrypoints.openai.serving_engine import ClientDisconnected, check_num_sequences
from kiln.entrypoints.openai.serving_models import ServingModels
from kiln.pooling.pooling_inputs import check_cross_encoder
from kiln.pooling.scoring import finish_scores, score_prompts

Texts = str | list[str]
# vLLM's names of the two sides, newest first
_PAIRS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
          ("text_1", "text_2"))


class _ScoreFields(ActivationFields):
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: JsonInt | None = None
    priority: JsonInt = 0
    request_id: str | None = None


class ScoreRequest(_ScoreFields):
    text_1: Texts | None = None
    text_2: Texts | None = None
    data_1: Texts | None = None
    data_2: Texts | None = None
    queries: Texts | None = None
    documents: Texts | None = None
    items: Texts | None = None

    def sides(self) -> tuple[tuple[str, str], Texts, Texts]:
        """The one pair of fields the body gives (their names, their texts)."""
        for names in _PAIRS:
            one, two = getattr(self, names[0]), getattr(self, names[1])
            if one is not None and two is not None:
                # a field of another pair beside it would be dropped unread: say so
                stray = [f for pair in _PAIRS for f in pair
                         if f not in names and getattr(self, f) is not None]
                if stray:
                    raise OpenAIError(f"{stray[0]} is given beside {names[0]} / {names[1]}: "
                                      "give the texts to score as one pair of fields",
                                      param=stray[0], code="invalid_value")
                return names, one, two
        missing = "text_2" if self.text_1 is not None else "text_1"
        raise OpenAIError(f"{missing} is missing: give the texts to score as text_1 and "
                          "text_2 (or data_1 / data_2, queries / documents, queries / items)",
                          param=missing, code="invalid_value")


class RerankRequest(_ScoreFields):
    query: str
    documents: Texts
    top_n: JsonInt = 0  # 0 (or less, as vLLM's): every document


class ServingScore:
    def __init__(self, llm: AsyncLLM, models: ServingModels):
        self.llm = llm
        self.models = models
        self.task = pooling_task(llm)

    async def score(self, req: ScoreRequest, raw: Request) -> Response:
        created = int(time.time())
        self.check_runner("Score")
        names, one, two = req.sides()
        request_id = response_id("score", req.request_id, raw)
        model, outs = await self._scores(req, raw, request_id, one, two, names)
        if outs is None:
            return Response(status_code=499)
        data = [ScoreData(index=i, score=float(o.outputs.data)) for i, o in enumerate(outs)]
        return JSONResponse(ScoreResponse(
            id=request_id, created=created, model=model, data=data,
            usage=pooling_usage(sum(len(o.prompt_token_ids) for o in outs))).model_dump())

    async def rerank(self, req: RerankRequest, raw: Request) -> Response:
        self.check_runner("Rerank")
        documents = [req.documents] if isinstance(req.documents, str) else req.documents
        if not documents:
            raise OpenAIError("documents is empty: give at least one document to rank",
                              param="documents", code="invalid_value")
        request_id = response_id("rerank", req.request_id, raw)
        model, outs = await self._scores(req, raw, request_id, req.query, documents,
                                         ("query", "documents"))
        if outs is None:
            return Response(status_code=499)
        ranked = sorted(range(len(outs)), key=lambda i: -float(outs[i].outputs.data))
        # top_n <= 0: every document, as vLLM's (a negative one too)
        results = [RerankResult(index=i, document=RerankDocument(text=documents[i]),
                                relevance_score=float(outs[i].outputs.data))
                   for i in ranked[:req.top_n if req.top_n > 0 else len(ranked)]]
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        return JSONResponse(RerankResponse(
            id=request_id, model=model, results=results,
            usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens)).model_dump())

    def check_runner(self, api: str) -> None:
        if self.task is None:
            raise refuse_task(api, None, "classify")
        if self.task == "classify":
            try:
                check_cross_encoder(self.llm.kiln_config.model_config)
            except ValueError as e:
                raise OpenAIError(f"The model does not support {api} API: {e}",
                                  code="unsupported_endpoint") from None

    async def _scores(self, req: _ScoreFields, raw: Request, request_id: str, one, two,
                      names: tuple[str, str]):
        """(the model's name, one scalar-output per pair), or None for the outputs where the
        client went away."""
        llm = self.llm
        model = resolve_model(self.models, req.model, raw.url.path)
        # the server's cap before any pair is tokenized
        check_num_sequences(len(two) if isinstance(two, list) else 1, 1,
                            llm.max_sequences_per_request, names[1])
        try:
            prompts, truncate, num_2 = await llm.run_in_engine(
                score_prompts, llm.engine, one, two, req.truncate_prompt_tokens, names)
        except ValueError as e:
            raise field_error(e, names[1]) from None
        params = activation_params(req, truncate)
        try:
            # the cap counts pairs, as checked above (an embedding model pools both sides)
            finals = await pool(llm, raw, request_id, prompts, params, req.priority,
                                names[1], num_sequences=num_2)
        except ClientDisconnected:
            return model, None
        pad = getattr(llm.tokenizer, "pad_token_id", None)
        return model, finish_scores(llm.kiln_config.model_config, finals, params, num_2, pad)


def add_score_routes(app, llm: AsyncLLM, models: ServingModels, chat=None) -> None:
    """/classify, the score and the rerank routes (vLLM's paths); each in the schema where this
    server's task serves it."""
    from kiln.entrypoints.openai.serving_classify import (
        ClassificationRequest,
        ServingClassification,
    )

    classification = ServingClassification(llm, models, chat)
    scores = ServingScore(llm, models)
    try:  # an embedding model scores too (cosine); a classifier with one label
        scores.check_runner("Score")
        scoring = True
    except OpenAIError:
        scoring = False

    @app.post("/classify", include_in_schema=classification.task == "classify")
    async def create_classify(req: ClassificationRequest, raw: Request):
        return await classification.create(req, raw)

    async def create_score(req: ScoreRequest, raw: Request):
        return await scores.score(req, raw)

    async def do_rerank(req: RerankRequest, raw: Request):
        return await scores.rerank(req, raw)

    for path in ("/score", "/v1/score"):
        app.add_api_route(path, create_score, methods=["POST"], include_in_schema=scoring,
                          operation_id=f"create_score{path.replace('/', '_')}")
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_api_route(path, do_rerank, methods=["POST"], include_in_schema=scoring,
                          operation_id=f"do_rerank{path.replace('/', '_')}")
