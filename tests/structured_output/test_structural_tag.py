"""Structural tags (vLLM's structural_tag, xgrammar's grammar): xgrammar's current form and
vLLM's legacy structures + triggers, as text or a dict; what the compiled grammar lets through
on a real tokenizer; bad tags refused naming the field, and the schemas and regexes inside one
checked as json and regex constraints are."""
import json

import pytest

from kiln.sampling_params import SamplingParams, StructuredOutputsParams
from kiln.structured_output.spec import grammar_spec
from kiln.structured_output.structural_tag import inner_constraints, legacy_problem
from kiln.structured_output.xgrammar_backend import check_structured_outputs

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# the whole output: <f>, an object of the schema, </f>
TAG = {"type": "structural_tag", "format": {"type": "tag", "begin": "<f>", "end": "</f>",
                                            "content": {"type": "json_schema",
                                                        "json_schema": SCHEMA}}}
# any text; where "<f" begins, the structure it triggers
LEGACY = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": SCHEMA,
                                                    "end": "</f>"}], "triggers": ["<f"]}


@pytest.fixture(scope="module")
def backend_and_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from kiln.structured_output.xgrammar_backend import XgrammarBackend

    from checkpoints import save_chat_tokenizer

    path = tmp_path_factory.mktemp("chat_tokenizer")
    save_chat_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return XgrammarBackend(tokenizer, len(tokenizer)), tokenizer


def _accepts(backend_and_tokenizer, tag, text: str) -> bool:
    """Whether the grammar compiled for the tag takes `text`'s tokens, then the end token."""
    backend, tokenizer = backend_and_tokenizer
    grammar = backend.compile(grammar_spec(StructuredOutputsParams(structural_tag=tag)))
    matcher = backend.matcher(grammar, [tokenizer.eos_token_id])
    ids = tokenizer.encode(text, add_special_tokens=False)
    return (all(matcher.accept_token(t) for t in ids)
            and matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated())


@pytest.mark.parametrize("tag", [TAG, json.dumps(TAG)])
def test_a_tag_is_the_whole_output(backend_and_tokenizer, tag):
    check_structured_outputs(StructuredOutputsParams(structural_tag=tag))
    assert _accepts(backend_and_tokenizer, tag, '<f>{"a": 12}</f>')
    for text in ('<f>{"a": "x"}</f>', '<f>{"a": 1, "b": 2}</f>', 'hi <f>{"a": 1}</f>',
                 '<f>{"a": 1}'):
        assert not _accepts(backend_and_tokenizer, tag, text), text


@pytest.mark.parametrize("tag", [LEGACY, json.dumps(LEGACY)])
def test_a_legacy_tag_leaves_text_free_until_a_trigger(backend_and_tokenizer, tag):
    """vLLM converts its legacy form for xgrammar (StructuralTagItem per structure): any text,
    and after a trigger the structure it begins, then free text again."""
    check_structured_outputs(StructuredOutputsParams(structural_tag=tag))
    for text in ("The quick brown fox", 'call <f>{"a": 1}</f> then <f>{"a": 2}</f> done'):
        assert _accepts(backend_and_tokenizer, tag, text), text
    for text in ('call <f>{"a": "x"}</f>', 'call <f>{"a": 1}'):
        assert not _accepts(backend_and_tokenizer, tag, text), text


def test_the_dict_forms_and_one_constraint():
    so = SamplingParams(structured_outputs={"structural_tag": json.dumps(TAG)}).structured_outputs
    assert so.kind == "structural_tag"
    assert grammar_spec(so).field == "structured_outputs.structural_tag"
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(structural_tag=TAG, regex="a")


@pytest.mark.parametrize("tag, message", [
    ("nope", "structural_tag is not valid JSON"),
    ("[]", "structural_tag must be a JSON object"),
    (3, "structural_tag must be a structural tag"),
    ({"bad": {1, 2}}, "structural_tag must hold JSON values only"),
    ("\"\\ud800\"", "structural_tag must be a JSON object"),
    ({"type": "structural_tag", "format": {"type": "const_string", "value": "\ud800"}},
     "structural_tag contains a lone UTF-16 surrogate"),
])
def test_a_tag_that_is_no_json_object_names_the_field(tag, message):
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{message}"):
        StructuredOutputsParams(structural_tag=tag)


@pytest.mark.parametrize("tag, message", [
    ({}, " is not a structural tag this server can compile: .*must have a format field"),
    ({"type": "structural_tag", "format": {"type": "nope"}}, " is not a structural tag"),
    ({**LEGACY, "triggers": ["<g"]}, " is not a structural tag this server can compile"),
    ({**LEGACY, "structures": [{"begin": "<f>", "end": "</f>"}]},
     r"\.structures must be a list of objects"),
    ({**LEGACY, "triggers": "<f"}, r"\.triggers must be a list of non-empty strings"),
    ({**LEGACY, "structures": [{"begin": "<f>", "schema": {"type": "objectx"}, "end": "</f>"}]},
     " is not a structural tag this server can compile: .*objectx"),
    # inside a tag, what a json / regex constraint refuses, at its place in the tag
    ({"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {
        "type": "array", "uniqueItems": True}}},
     r" \(its schema at /format/json_schema\) uses JSON Schema keywords .*uniqueItems"),
    ({**LEGACY, "structures": [{"begin": "<f>", "schema": {"type": "array", "contains": {}},
                                "end": "</f>"}]},
     r" \(its schema at /structures/0/schema\) uses JSON Schema keywords .*contains"),
    ({"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "x"}, {"type": "regex", "pattern": "a$b"}]}},
     r" \(its regex at /format/elements/1/pattern\) has \$ inside the pattern"),
])
def test_a_bad_tag_is_refused_naming_the_field(tag, message):
    with pytest.raises(ValueError, match=rf"^structured_outputs\.structural_tag{message}") as e:
        check_structured_outputs(StructuredOutputsParams(structural_tag=tag))
    assert ".cc:" not in str(e.value)


def test_inner_constraints_walk_formats_not_schemas():
    inner = {"type": "object", "properties": {"type": {"const": "regex"},
                                              "pattern": {"type": "string"}}}
    tag = {"type": "structural_tag", "format": {"type": "or", "elements": [
        {"type": "json_schema", "json_schema": inner},
        {"type": "tag", "begin": "<r>", "end": "</r>",
         "content": {"type": "regex", "pattern": "[0-9]+"}}]}}
    assert inner_constraints(tag) == ([("/format/elements/0/json_schema", inner)],
                                      [("/format/elements/1/content/pattern", "[0-9]+")])
    assert inner_constraints(LEGACY) == ([("/structures/0/schema", SCHEMA)], [])
    assert legacy_problem(LEGACY) is None
