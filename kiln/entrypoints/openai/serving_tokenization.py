"""POST /tokenize and /detokenize: the server's tokenizer, for clients that count tokens.

A tokenize request gives either `prompt` text or chat `messages` (rendered by the template).
"""
from kiln.engine.async_llm import AsyncLLM
from kiln.engine.bulk_tokenizer import BulkTokenizer, BulkTokenizerDied, tokenize_response_json
from kiln.engine.detokenizer import fast_decode
from kiln.engine.frontend_lanes import BULK_NICENESS, is_bulk
from kiln.engine.text_encoding import encode_text, encoding_problem, plain_backend
from kiln.entrypoints.openai.chat_rendering import (
    check_generation_flags,
    render_chat_prompt,
    request_chat_template,
)
from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from kiln.entrypoints.openai.request_defaults import RequestDefaults
from kiln.entrypoints.openai.response_models import DetokenizeResponse
from kiln.entrypoints.openai.serving_models import ServingModels
from kiln.entrypoints.openai.tool_parsers.tool_plan import check_tools, template_tool_dicts
from kiln.logger import init_logger

logger = init_logger(__name__)


class ServingTokenization:
    def __init__(self, llm: AsyncLLM, models: ServingModels, vocab_size: int,
                 trust_request_chat_template: bool = False,
                 defaults: RequestDefaults | None = None):
        self.llm = llm
        self.defaults = defaults or RequestDefaults()
        self.trust_request_chat_template = trust_request_chat_template
        self.models = models
        self.vocab_size = vocab_size
        # Huge text prompts' ids and JSON in a child process (bulk_tokenizer.py), where the
        # tokenizer is the plain `tokenizers` backend; else (and for chat messages, and token
        # strings) on the bulk lane's thread.
        backend = plain_backend(llm.tokenizer)  # None without a tokenizer too
        self.bulk = BulkTokenizer(backend, BULK_NICENESS) if backend is not None else None

    def start(self) -> None:
        if self.bulk is not None:
            self.bulk.start()
            self._give_up_if_unusable()

    def _give_up_if_unusable(self) -> None:
        if self.bulk is not None and self.bulk.unusable is not None:
            logger.warning("%s: huge /tokenize texts are tokenized in this process from now on",
                           self.bulk.unusable)
            self.bulk = None

    def close(self) -> None:
        bulk, self.bulk = self.bulk, None  # requests still in flight tokenize here
        if bulk is not None:
            bulk.close()

    def _tokenizer(self, param: str):
        if self.llm.tokenizer is None:
            raise OpenAIError("this server runs without a tokenizer (--skip-tokenizer-init): "
                              "it takes and returns token ids only", param=param,
                              code="unsupported_parameter")
        return self.llm.tokenizer

    async def tokenize(self, req: TokenizeRequest) -> bytes:
        """The response body, TokenizeResponse as JSON, built on a front-end thread with the
        tokenizing: a 4 MB prompt's million ids through pydantic and model_dump held the event
        loop, and every stream's next token, ~35 ms (2 cores, quiet)."""
        self.models.resolve(req.model)
        tokenizer = self._tokenizer("prompt" if req.prompt is not None else "messages")
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError("give exactly one of prompt or messages", param="prompt",
                              code="invalid_value")
        if req.messages is not None:
            check_generation_flags(req)
            if req.tools:  # what a chat with these tools refuses (a blank name, say), too
                check_tools(req.tools)
            prompt = await render_chat_prompt(
                self.llm, req.messages, req.add_generation_prompt, req.continue_final_message,
                self.defaults.template_kwargs(req.chat_template_kwargs),
                bool(req.add_special_tokens),
                template_tool_dicts(req.tools), req.documents,
                request_chat_template(req, self.trust_request_chat_template))
            # The ids as the argument: their number picks the thread (frontend_lanes.py).
            return await self.llm.run_in_engine(
                lambda ids: self._response_body(tokenizer, ids, req.return_token_strs),
                prompt["prompt_token_ids"])
        add_special = req.add_special_tokens is not False
        problem = encoding_problem(req.prompt)
        if problem is not None:
            raise OpenAIError(f"prompt {problem}", param="prompt", code="invalid_value")

        def tokenize_text(text: str) -> bytes:
            if self.bulk is not None and is_bulk((text,), {}) and not req.return_token_strs:
                try:
                    return self.bulk.tokenize_json(text, add_special,
                                                   self.models.max_model_len)
                except BulkTokenizerDied as e:
                    logger.warning("%s: tokenizing this request here", e)
                    self._give_up_if_unusable()
            ids = encode_text(tokenizer, text, add_special_tokens=add_special)
            return self._response_body(tokenizer, ids, req.return_token_strs)
        return await self.llm.run_in_engine(tokenize_text, req.prompt)

    def _response_body(self, tokenizer, ids: list[int], with_strs: bool) -> bytes:
        strs = tokenizer.convert_ids_to_tokens(ids) if with_strs else None
        return tokenize_response_json(ids, self.models.max_model_len, strs)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.models.resolve(req.model)
        decode, vocab = fast_decode(self._tokenizer("tokens")), self.vocab_size

        def detokenize_ids(ids: list[int]) -> str:
            # Off the event loop, the check too (a 4 MB body is ~700,000 ids); the backend's
            # decode where it equals transformers': that one holds the GIL for most of its work.
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise OpenAIError(f"tokens contains {bad}, outside the vocabulary [0, {vocab})",
                                  param="tokens", code="invalid_value")
            return decode(ids)
        return DetokenizeResponse(prompt=await self.llm.run_in_engine(detokenize_ids,
                                                                      req.tokens))

