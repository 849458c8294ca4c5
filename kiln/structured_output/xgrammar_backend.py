"""xgrammar behind Kiln's structured outputs: checking a spec (no tokenizer needed, so the front
end can refuse a bad schema as a 400) and compiling it against the model's vocabulary (core side).
"""
import functools
import json
import math
import re

from kiln.engine.text_encoding import encode_text
from kiln.structured_output.json_schema_rules import regex_anchor_problem, unenforced_keywords
from kiln.structured_output.params import StructuredOutputsParams
from kiln.structured_output.spec import GrammarSpec, grammar_spec
from kiln.structured_output.structural_tag import (
    inner_constraints,
    is_legacy,
    legacy_problem,
    tag_object,
)

# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:123: ": the user needs the rest.
_ANY_OBJECT = '{"type": "object"}'
_CACHE_LIMIT_BYTES = 512 * 1024 * 1024
# Specs checked by the front end are remembered (a client repeats its schema) only up to this
# size: the cache is bounded by count, and 256 distinct multi-megabyte schemas (a body may be
# 4 MiB) held a gigabyte for the server's life. A big spec costs its size to check anyway.
_SPEC_CACHE_MAX_CHARS = 64 * 1024
_CPP_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")


def _clean(e: Exception) -> str:
    text = str(e)
    if isinstance(e, UnicodeDecodeError) and isinstance(e.object, bytes):
        # xgrammar's message quotes the input byte by byte, so it can cut a character in two
        # and its binding fails to decode it: the message is in the bytes.
        text = e.object.decode("utf-8", "replace")
    return _CPP_PREFIX.sub("", text).strip()


def _import_xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # a broken install: name the package that fixes it
        raise ValueError(f"structured outputs need the xgrammar package ({e}); "
                         "pip install xgrammar") from None
    return xgrammar


def check_structured_outputs(params: StructuredOutputsParams) -> None:
    """Raise ValueError naming the request field when the schema, regex or grammar does not
    parse (the tokenizer-independent half of compiling: it is quick, and cached)."""
    spec = grammar_spec(params)
    check = _spec_error if len(spec.text) <= _SPEC_CACHE_MAX_CHARS else _spec_error.__wrapped__
    error = check(spec)
    if error is not None:
        raise ValueError(error)


@functools.lru_cache(maxsize=256)
def _spec_error(spec: GrammarSpec) -> str | None:
    try:
        check_spec(spec)
    except ValueError as e:
        return str(e)
    return None


def check_spec(spec: GrammarSpec) -> None:
    xgr = _import_xgrammar()
    if spec.kind == "json":
        try:
            schema = json.loads(spec.text)
        except ValueError:
            schema = None  # not JSON: xgrammar's own error names what is wrong
        _check_enforceable(schema, spec.field)
    elif spec.kind == "regex":
        _check_anchors(spec.text, spec.field)
    elif spec.kind == "structural_tag":
        _check_structural_tag(spec)
    try:
        if spec.kind == "json":
            xgr.Grammar.from_json_schema(spec.text, any_whitespace=spec.any_whitespace,
                                         strict_mode=True)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.text)
        elif spec.kind == "ebnf":
            xgr.Grammar.from_ebnf(spec.text)
        elif spec.kind == "lark":
            xgr.Grammar.from_lark(spec.text)
        elif spec.kind == "structural_tag":
            xgr.Grammar.from_structural_tag(_structural_tag_text(xgr, spec))
    except (RuntimeError, ValueError, TypeError) as e:
        what = {"json": "JSON schema", "regex": "regex", "ebnf": "EBNF grammar",
                "lark": "Lark grammar", "structural_tag": "structural tag"}[spec.kind]
        raise ValueError(f"{spec.field} is not a {what} this server can compile: "
                         f"{_clean(e)}") from None


def _check_enforceable(schema, where: str) -> None:
    """Refuse a schema with keywords the grammar would not enforce (vLLM refuses some of them
    too): served, its outputs could break the schema while finishing as `stop`."""
    unenforced = unenforced_keywords(schema) if schema is not None else []
    if unenforced:
        raise ValueError(f"{where} uses JSON Schema keywords this server's grammar "
                         f"(xgrammar) does not enforce, so outputs could break them: "
                         f"{', '.join(unenforced)}; remove them (and check them after "
                         "generation)")


def _check_anchors(regex: str, where: str) -> None:
    if (problem := regex_anchor_problem(regex)) is not None:
        raise ValueError(f"{where} has {problem}, which this server's grammar (xgrammar) "
                         "would misread: the regex always matches the whole output, so drop "
                         "the anchor")


def _check_structural_tag(spec: GrammarSpec) -> None:
    """A legacy tag's shape, and the checks its schemas and regexes get as json and regex
    constraints (a JSON pointer into the tag names each)."""
    tag = tag_object(spec.text)
    if is_legacy(tag) and (problem := legacy_problem(tag)) is not None:
        raise ValueError(f"{spec.field}.{problem}")
    schemas, regexes = inner_constraints(tag)
    for pointer, schema in schemas:
        _check_enforceable(schema, f"{spec.field} (its schema at {pointer})")
    for pointer, regex in regexes:
        _check_anchors(regex, f"{spec.field} (its regex at {pointer})")


def _structural_tag_text(xgr, spec: GrammarSpec) -> str:
    """The structural tag as xgrammar's current form takes it: a legacy one converted, as vLLM
    converts it."""
    tag = tag_object(spec.text)
    if not is_legacy(tag):
        return spec.text
    items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]),
                                   end=s["end"]) for s in tag["structures"]]
    return xgr.StructuralTag.from_legacy_structural_tag(items, tag["triggers"]).model_dump_json()


class XgrammarBackend:
    """Compiles specs for one vocabulary; matchers follow one request's tokens."""

    def __init__(self, tokenizer, vocab_size: int, max_threads: int = 2):
        self.xgr = _import_xgrammar()
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        info = self.xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # xgrammar keeps its own cache too (by grammar text), bounded as vLLM bounds it.
        self.compiler = self.xgr.GrammarCompiler(info, max_threads=max_threads,
                                                 cache_limit_bytes=_CACHE_LIMIT_BYTES)

    @property
    def bitmask_width(self) -> int:
        return math.ceil(self.vocab_size / 32)

    def compile(self, spec: GrammarSpec):
        c = self.compiler
        if spec.kind == "json":
            return c.compile_json_schema(spec.text, any_whitespace=spec.any_whitespace,
                                         strict_mode=True)
        if spec.kind == "json_object":
            # An object, as OpenAI's json_object means (xgrammar's builtin JSON grammar also
            # takes arrays and scalars); any keys: not strict.
            return c.compile_json_schema(_ANY_OBJECT, any_whitespace=spec.any_whitespace,
                                         strict_mode=False)
        if spec.kind == "regex":
            return c.compile_regex(spec.text)
        if spec.kind == "ebnf":
            return c.compile_grammar(spec.text)
        if spec.kind == "lark":
            return c.compile_lark(spec.text)
        if spec.kind == "structural_tag":
            return c.compile_structural_tag(_structural_tag_text(self.xgr, spec))
        raise ValueError(f"unknown grammar kind {spec.kind!r}")

    def token_ids(self, text: str) -> list[int]:
        return encode_text(self.tokenizer, text, add_special_tokens=False)

    def matcher(self, compiled, stop_token_ids: list[int]):
        """A matcher that ends on any of the request's stop tokens."""
        return self.xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)
