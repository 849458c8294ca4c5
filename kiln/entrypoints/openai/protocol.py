"""Pydantic models of the requests Kiln's OpenAI HTTP API takes (plus vLLM's sampling extras),
built on protocol_base.py's base and JSON field types, which the responses share
(response_models.py).

Unknown request fields are ignored with a warning in the log, as vLLM does; wrong types fail
validation. Every field vLLM accepts is here, and is honoured or refused
(entrypoints/openai/sampling.py), as are OpenAI's that would change the output.
"""
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import Discriminator, Field, StrictBool, Tag, WithJsonSchema, model_validator

from kiln.entrypoints.openai.openai_limits import FORMAT_NAME_SCHEMA
from kiln.entrypoints.openai.protocol_base import (
    JsonFloat,
    JsonInt,
    RequestBase,
    RequestPart,
    TokenIds,
    warn_ignored_fields,
)
from kiln.logger import init_logger
from kiln.repetition_detection import MAX_MIN_COUNT

logger = init_logger(__name__)


# OpenAI's reasoning efforts and vLLM's "max": chat's reasoning_effort, /v1/responses'
# reasoning.effort
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
REASONING_EFFORTS = get_args(ReasoningEffort)

class StreamOptions(RequestBase):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class ResponseFormat(RequestBase):
    type: Literal["text", "json_object", "json_schema", "structural_tag"] = "text"
    # {"name": ..., "schema": {...}, "strict": ...} for type json_schema
    json_schema: dict[str, Any] | None = Field(None, json_schema_extra={
        "properties": {"name": {"type": "string", **FORMAT_NAME_SCHEMA}}})
    # type structural_tag (vLLM's): xgrammar's format object, or vLLM's legacy structures
    # ([{"begin", "schema", "end"}]) with their triggers (structured_fields.py)
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


class RepetitionDetection(RequestBase):
    """vLLM's request field `repetition_detection` (its RepetitionDetectionParams): null inside
    is a 400 as there, not 0; kiln/repetition_detection.check_fields checks the rest (its
    schema: openapi_sampling.repetition_detection_object)."""
    null_kept: ClassVar[frozenset[str]] = frozenset({
        "max_pattern_size", "min_pattern_size", "min_count"})
    max_pattern_size: JsonInt = Field(0, ge=0)
    min_pattern_size: JsonInt = Field(0, ge=0)
    min_count: JsonInt = Field(0, ge=0, le=MAX_MIN_COUNT)  # checked where no size is set too


# OpenAI's request fields that change nothing a local model writes: ignored without a warning.
_NO_EFFECT_FIELDS = frozenset({"metadata", "store", "service_tier", "prediction",
                               "prompt_cache_key", "safety_identifier"})


class SamplingFields(RequestBase):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    # vLLM types repetition detection's fields int, not optional: null is a 400 naming the
    # field there, not 0 (off)
    null_kept: ClassVar[frozenset[str]] = frozenset({
        "max_repetition_pattern_size", "min_repetition_pattern_size", "repetition_min_count"})

    @model_validator(mode="before")
    @classmethod
    def _log_ignored(cls, data):
        warn_ignored_fields(logger, cls, data, _NO_EFFECT_FIELDS)
        return data
    model: str | None = None
    temperature: JsonFloat | None = None
    top_p: JsonFloat | None = None
    # at most KILN_MAX_N_SEQUENCES (vLLM's VLLM_MAX_N_SEQUENCES), which SamplingParams checks
    n: JsonInt = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: JsonInt | None = None
    presence_penalty: JsonFloat = 0.0
    frequency_penalty: JsonFloat = 0.0
    logit_bias: dict[str, JsonFloat] | None = None
    user: str | None = None  # accepted, ignored
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # vLLM extras
    top_k: JsonInt | None = None
    min_p: JsonFloat | None = None
    repetition_penalty: JsonFloat | None = None
    ignore_eos: StrictBool = False
    min_tokens: JsonInt = 0
    stop_token_ids: list[JsonInt] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    best_of: JsonInt | None = None  # only 1: no ranking of extra samples
    use_beam_search: StrictBool = False  # beam search: n beams (openai/beam_search.py)
    length_penalty: JsonFloat = 1.0  # beam search only: refused without use_beam_search
    # false (with skip_special_tokens false): no spaces between two special tokens in a row
    spaces_between_special_tokens: StrictBool = True
    truncate_prompt_tokens: JsonInt | None = Field(None, ge=-1)
    allowed_token_ids: list[JsonInt] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: JsonInt | None = None
    # vLLM's: lower is served first under --scheduling-policy priority; fcfs ignores it
    priority: JsonInt = Field(0, ge=-2**63, lt=2**63)
    request_id: str | None = None  # names the response (cmpl-<request_id>)
    logits_processors: list[Any] | None = None  # refused: no user code in the sampler
    return_tokens_as_token_ids: StrictBool | None = None  # logprob tokens as "token_id:<id>"
    cache_salt: str | None = None  # prefix-cache blocks are shared only with the same salt
    kv_transfer_params: dict[str, Any] | None = None  # refused: no disaggregated serving
    # refused: for custom logits processors and plugins (vLLM's extra_args), none loaded here
    vllm_xargs: dict[str, Any] | None = None
    return_token_ids: StrictBool | None = None  # choices carry token_ids, the response prompt's
    # vLLM's repetition detection (kiln/repetition_detection.py): the output ending in a pattern
    # of min..max tokens repeated min_count times ends it (finish_reason "repetition"). Current
    # vLLM's object, or its earlier flat fields (not both: sampling.py)
    repetition_detection: RepetitionDetection | None = None
    max_repetition_pattern_size: JsonInt = Field(0, ge=0)
    min_repetition_pattern_size: JsonInt = Field(0, ge=0)
    repetition_min_count: JsonInt = Field(0, ge=0)
    # Structured outputs (structured_fields.py): OpenAI's response_format, vLLM's
    # structured_outputs ({"json" | "regex" | "choice" | "grammar" | "json_object" |
    # "structural_tag": ...}) and its older guided_* names and structural_tag (a JSON text).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: str | None = None
    # vLLM's, refused (sampling.OFF_ONLY): each would change the output if honoured
    guided_whitespace_pattern: str | None = None
    logprob_token_ids: Any = None
    thinking_token_budget: Any = None
    truncation_side: str | None = None


def _prompt_shape(value) -> str | None:
    """The PromptInput member a `prompt` is, from its first item, so that one member validates
    it: as a plain union, a list of 600k ids was first tried (and failed) as list[str] id by id.
    Tags are pydantic's member names, which error locations drop (errors._loc_to_param)."""
    if isinstance(value, (str, bytes)):
        return "str"
    if not isinstance(value, (list, tuple)):
        return None
    first = value[0] if value else ""
    if isinstance(first, list):
        return "list[list[int]]"
    return "list[str]" if isinstance(first, str) else "list[int]"


# JSON true / false are no token ids.
PromptInput = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[str], Field(fail_fast=True), Tag("list[str]")]
    | Annotated[TokenIds, Tag("list[int]")]
    | Annotated[list[TokenIds], Field(fail_fast=True), Tag("list[list[int]]")],
    Discriminator(_prompt_shape, custom_error_type="invalid_type",
                  custom_error_message="must be a string, a list of strings, a list of token ids "
                                       "or a list of lists of token ids"),
    WithJsonSchema({"anyOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "string"}},
        {"type": "array", "items": {"type": "integer"}},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}]})]


class CompletionRequest(SamplingFields):
    # max_tokens null: up to the context's end (vLLM's), where absent is 16.
    null_kept: ClassVar[frozenset[str]] = SamplingFields.null_kept | {"max_tokens"}
    prompt: PromptInput
    max_tokens: JsonInt | None = 16
    logprobs: JsonInt | None = None
    echo: StrictBool = False
    suffix: str | None = None
    prompt_embeds: Any = None  # refused: prompts are text or token ids
    # BOS (where the tokenizer adds one) before text prompts
    add_special_tokens: StrictBool = True


class TextContentPart(RequestPart):
    type: str
    text: str | None = None
    refusal: str | None = None  # the text of an assistant history's "refusal" part


class ChatMessage(RequestPart):
    role: str
    # plain strings among the parts are text, as vLLM (and LLM.chat) take them
    content: str | list[str | TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's newer name for reasoning_content


class FunctionDefinition(RequestBase):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ChatCompletionTool(RequestBase):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestBase):
    name: str


class NamedToolChoice(RequestBase):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: JsonInt | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: JsonInt | None = None
    logprobs: StrictBool = False
    top_logprobs: JsonInt | None = None
    tools: list[ChatCompletionTool] | None = None
    # None: "auto" with tools, "none" without (OpenAI's default)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    include_reasoning: StrictBool = True  # false: no reasoning_content (needs --reasoning-parser)
    # vLLM's: the chat template's reasoning_effort variable (over chat_template_kwargs'), and
    # enable_thinking (serving_chat.reasoning_effort_variables)
    reasoning_effort: ReasoningEffort | None = None
    # vLLM extras for the template
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: StrictBool = False  # on top of what the template writes (BOS, usually)
    echo: StrictBool = False  # the reply starts with the last message when it is the same role's
    documents: list[dict[str, str]] | None = None  # for templates that render documents (RAG)
    chat_template: str | None = None  # Jinja text; needs --trust-request-chat-template
    mm_processor_kwargs: dict[str, Any] | None = None  # refused: text-only models
    # OpenAI's, refused: legacy functions (use tools), audio output
    functions: list[Any] | None = None
    function_call: Any = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None


class TokenizeRequest(RequestBase):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # default (null): true for a prompt, false for messages (their template writes them), as in
    # vLLM's two tokenize requests
    add_special_tokens: StrictBool | None = Field(
        None, description="default: true for prompt, false for messages")
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False  # as in chat completions, so counts agree
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # as in chat completions
    # what the chat template renders besides the messages, as in chat completions (vLLM's)
    tools: list[ChatCompletionTool] | None = None
    documents: list[dict[str, str]] | None = None
    return_token_strs: StrictBool = False


class DetokenizeRequest(RequestBase):
    model: str | None = None
    tokens: TokenIds
