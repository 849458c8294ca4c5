"""`StructuredOutputsParams`: vLLM's constraint on what a request may generate (a schema, regex,
choice list or grammar), checked up front with errors naming the field.
"""
import functools
import json
from dataclasses import dataclass

from kiln.engine.text_encoding import check_texts
from kiln.structured_output.json_schema_rules import MAX_SCHEMA_DEPTH, schema_depth
from kiln.structured_output.structural_tag import tag_object

# The constraints of StructuredOutputsParams: exactly one is set.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """vLLM's constraint on what a request may generate, as plain data (it crosses to the
    engine core as is): a JSON schema (dict or its text), a regex, a list of choices, an EBNF or
    Lark grammar, any JSON object, or an xgrammar structural tag (dict or its text). The core
    compiles it (kiln/structured_output)."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # No free whitespace between JSON tokens (vLLM's flag): compact, bounded output.
    disable_any_whitespace: bool = False
    # The grammar applies only after this text (a reasoning parser's end marker, "</think>"):
    # a thinking model thinks freely first, as vLLM does with a reasoning parser. The server
    # sets it; None: from the first token.
    reasoning_end: str | None = None
    # xgrammar's structural tag, vLLM's field: {"type": "structural_tag", "format": {...}}, or
    # its legacy {"structures": [{"begin", "schema", "end"}], "triggers": [...]} (any text until
    # a trigger, then the structure it begins). JSON text, as vLLM takes it, or a dict.
    structural_tag: str | dict | None = None

    def __post_init__(self):
        self.verify()

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_OUTPUT_KINDS
                    if getattr(self, k) not in (None, False))

    def verify(self) -> None:
        if isinstance(self.json, bool):  # else `false` read as not given: "got none"
            raise ValueError("structured_outputs.json must be a JSON schema (dict or str), got "
                             f"{self.json!r}")
        given = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of "
                             f"{list(STRUCTURED_OUTPUT_KINDS)}, got {given or 'none'}")
        schema = self.json
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except (ValueError, RecursionError) as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object), "
                                 f"got {type(schema).__name__}")
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError("structured_outputs.json must be a JSON schema (dict or str), got "
                             f"{type(self.json).__name__}")
        json_text = self.json
        if isinstance(self.json, dict):
            try:  # a set or bytes inside failed later, deep in building the grammar
                json_text = json.dumps(self.json, ensure_ascii=False)
            except (TypeError, ValueError) as e:
                raise ValueError(f"structured_outputs.json must hold JSON values only: {e}"
                                 ) from None
        depth = schema_depth(schema) if self.json is not None else 0
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"structured_outputs.json nests {depth} objects and arrays deep; "
                             f"at most {MAX_SCHEMA_DEPTH} are accepted")
        tag_text = self._check_structural_tag()
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, str) and v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, "
                                 f"got {v!r}")
        if self.choice is not None and not (
                isinstance(self.choice, (list, tuple)) and self.choice
                and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty "
                             f"strings, got {self.choice!r}")
        if self.choice is not None:
            self.choice = list(self.choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be true, got "
                             f"{self.json_object!r}")
        if self.reasoning_end is not None and not (isinstance(self.reasoning_end, str)
                                                   and self.reasoning_end):
            raise ValueError("structured_outputs.reasoning_end must be None or a non-empty "
                             f"string, got {self.reasoning_end!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be True or False, "
                             f"got {self.disable_any_whitespace!r}")
        for name, texts in (("json", [json_text]), ("regex", [self.regex]),
                            ("choice", self.choice or ()), ("grammar", [self.grammar]),
                            ("reasoning_end", [self.reasoning_end]),
                            ("structural_tag", [tag_text])):
            # the grammar compiler's codec error named no character; reasoning_end's failed
            # on its way to the engine core
            check_texts(f"structured_outputs.{name}", [t for t in texts if t is not None])

    def _check_structural_tag(self) -> str | None:
        """The structural tag's JSON text (None without one): a JSON object, of JSON values,
        nested no deeper than a schema may be (it holds schemas)."""
        if self.structural_tag is None:
            return None
        name = "structured_outputs.structural_tag"
        if not isinstance(self.structural_tag, (str, dict)):
            raise ValueError(f"{name} must be a structural tag (a JSON object or its text), "
                             f"got {type(self.structural_tag).__name__}")
        try:
            tag = tag_object(self.structural_tag)
        except ValueError as e:
            raise ValueError(f"{name} {e}") from None
        depth = schema_depth(tag)
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"{name} nests {depth} objects and arrays deep; at most "
                             f"{MAX_SCHEMA_DEPTH} are accepted")
        try:
            return json.dumps(tag, ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{name} must hold JSON values only: {e}") from None


# vLLM's StructuredOutputsParams fields with no counterpart here: a script passing one got a
# bare TypeError ("unexpected keyword argument"); now a ValueError saying why. vLLM's
# disable_fallback is taken: Kiln has one grammar backend, nothing to fall back to.
_VLLM_ONLY_STRUCTURED_FIELDS = {
    "whitespace_pattern": "JSON's whitespace follows JSON's grammar (none with "
                          "disable_any_whitespace=True)",
    "disable_additional_properties": "it is vLLM's guidance-backend option; Kiln's grammars "
                                     "follow the schema's additionalProperties as written",
}
# Every keyword StructuredOutputsParams(...) takes: what its dict form (SamplingParams'
# structured_outputs, a request body's) may hold. Without vLLM's names the dict refused
# disable_fallback, which the class takes, and named a vLLM-only field "unknown", not why.
# TAKEN: those that set something (what an "unknown field" error lists).
TAKEN_STRUCTURED_OUTPUT_KEYWORDS = frozenset(
    {*StructuredOutputsParams.__dataclass_fields__, "disable_fallback"})
STRUCTURED_OUTPUT_KEYWORDS = TAKEN_STRUCTURED_OUTPUT_KEYWORDS | set(_VLLM_ONLY_STRUCTURED_FIELDS)
_dataclass_init = StructuredOutputsParams.__init__


@functools.wraps(_dataclass_init)
def _init_with_vllm_fields(self, *args, disable_fallback: bool = False, **kwargs):
    for name, why in _VLLM_ONLY_STRUCTURED_FIELDS.items():
        if kwargs.pop(name, None) not in (None, False):
            raise ValueError(f"structured_outputs.{name} is not supported: {why}")
    if not isinstance(disable_fallback, bool):  # taken, so checked as vLLM's bool field is
        raise ValueError("structured_outputs.disable_fallback must be True or False, got "
                         f"{disable_fallback!r}")
    _dataclass_init(self, *args, **kwargs)


StructuredOutputsParams.__init__ = _init_with_vllm_fields
