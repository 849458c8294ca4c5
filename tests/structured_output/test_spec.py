"""StructuredOutputsParams and what it compiles to: exactly one constraint, each checked up
front; a schema, regex or grammar that does not parse is refused naming its field; choices are
escaped; identical requests share one spec (the cache key)."""
import json

import pytest

from kiln.sampling_params import SamplingParams, StructuredOutputsParams
from kiln.structured_output.json_schema_rules import (
    MAX_SCHEMA_DEPTH,
    schema_depth,
    unenforced_keywords,
)
from kiln.structured_output.spec import choice_ebnf, grammar_spec
from kiln.structured_output.xgrammar_backend import check_structured_outputs


@pytest.mark.parametrize("kw, message", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"json": "{bad"}, "structured_outputs.json is not valid JSON"),
    ({"json": 3}, "structured_outputs.json must be"),
    ({"json": False}, "structured_outputs.json must be"),  # said "got none"
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", 1]}, "structured_outputs.choice"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"json_object": "yes"}, "structured_outputs.json_object must be true"),
])
def test_bad_params_name_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kw)



def test_vllms_other_fields_are_refused_saying_why_or_taken():
    """vLLM's StructuredOutputsParams(whitespace_pattern=..., disable_additional_properties=True)
    raised a bare TypeError (unexpected keyword); disable_fallback (nothing to fall back to
    here) is taken, and structural_tag (a constraint of its own: test_structural_tag.py)."""
    for kw in ({"whitespace_pattern": " "}, {"disable_additional_properties": True}):
        with pytest.raises(ValueError, match=f"structured_outputs.{next(iter(kw))} is not "
                                             "supported"):
            StructuredOutputsParams(json={"type": "object"}, **kw)
    assert StructuredOutputsParams(regex="a", disable_fallback=True) == \
        StructuredOutputsParams(regex="a")
    assert StructuredOutputsParams(regex="a", structural_tag=None,
                                   disable_additional_properties=False).regex == "a"
    with pytest.raises(ValueError, match=r"exactly one of .*got \['json', 'structural_tag'\]"):
        StructuredOutputsParams(json={"type": "object"}, structural_tag="{}")

def test_the_dict_forms_take_what_the_class_takes():
    """SamplingParams(structured_outputs={...}) and a request's structured_outputs refused
    vLLM's disable_fallback as an unknown field though StructuredOutputsParams takes it, and
    named whitespace_pattern unknown rather than saying why."""
    from kiln.entrypoints.openai.errors import OpenAIError
    from kiln.entrypoints.openai.structured_fields import build_params

    taken = {"regex": "a", "disable_fallback": True}
    assert SamplingParams(structured_outputs=dict(taken)).structured_outputs == \
        StructuredOutputsParams(regex="a")
    assert build_params(dict(taken), "structured_outputs") == StructuredOutputsParams(regex="a")
    vllm_only = {"regex": "a", "whitespace_pattern": " "}
    with pytest.raises(ValueError, match="whitespace_pattern is not supported: JSON's"):
        SamplingParams(structured_outputs=dict(vllm_only))
    with pytest.raises(OpenAIError, match="whitespace_pattern is not supported: JSON's"):
        build_params(dict(vllm_only), "structured_outputs")
    with pytest.raises(OpenAIError, match=r"unknown field\(s\) \['jsn'\]; known: \[.*"
                                          r"'disable_fallback'"):
        build_params({"jsn": {}}, "structured_outputs")
    with pytest.raises(ValueError, match="disable_fallback must be True or False"):
        StructuredOutputsParams(regex="a", disable_fallback="yes")


def test_sampling_params_take_the_dict_form():
    p = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert p.structured_outputs == StructuredOutputsParams(regex="[0-9]+")
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs="json")


@pytest.mark.parametrize("kw, message", [
    ({"json": {"type": "objectx"}}, "structured_outputs.json is not a JSON schema"),
    ({"regex": "a(b"}, "structured_outputs.regex is not a regex"),
    ({"grammar": "root ::= nope"}, "structured_outputs.grammar is not a EBNF grammar"),
    ({"grammar": "start: )("}, "structured_outputs.grammar is not a Lark grammar"),
])
def test_uncompilable_is_refused_naming_it(kw, message):
    with pytest.raises(ValueError, match=message) as e:
        check_structured_outputs(StructuredOutputsParams(**kw))
    assert "/project/" not in str(e.value) and ".cc:" not in str(e.value)


def test_a_parse_error_at_a_multibyte_character_is_the_parsers_message():
    """xgrammar quotes the input cut at a byte (schemathesis drew this): its message, not a
    UTF-8 decoding error."""
    with pytest.raises(ValueError, match="structured_outputs.grammar is not a Lark grammar") as e:
        check_structured_outputs(StructuredOutputsParams(grammar="OC\u00e6^"))
    assert "line 1, column 3" in str(e.value) and "codec" not in str(e.value)


def test_valid_specs_pass_and_choices_are_escaped():
    choices = ['say "hi"', "back\\slash", "line\nbreak", "ünï"]
    assert json.loads(choice_ebnf(choices).split(" ::= ")[1].split(" | ")[1]) == choices[1]
    for kw in ({"json": {"type": "object"}}, {"json": '{"type": "integer"}'},
               {"regex": r"\d{3}"}, {"choice": choices}, {"json_object": True},
               {"grammar": 'root ::= "a" | "b"'}, {"grammar": 'start: "a" | "b"'}):
        check_structured_outputs(StructuredOutputsParams(**kw))


def test_same_request_same_spec():
    a = grammar_spec(StructuredOutputsParams(json={"type": "object", "properties": {}}))
    b = grammar_spec(StructuredOutputsParams(json='{"type": "object", "properties": {}}'))
    assert a == b and hash(a) == hash(b)
    c = grammar_spec(StructuredOutputsParams(json={"type": "object", "properties": {}},
                                             disable_any_whitespace=True))
    assert c != a and not c.any_whitespace
    assert grammar_spec(StructuredOutputsParams(grammar="start: x")).kind == "lark"


def _nested_arrays(depth: int) -> dict:
    schema = {"type": "integer"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def test_a_schema_nested_past_the_limit_is_refused_as_dict_and_text():
    """500 levels overflowed Python's recursion copying the request (a 500 on the server), and
    checking a few hundred took seconds."""
    deep = _nested_arrays(MAX_SCHEMA_DEPTH + 1)
    assert schema_depth(deep) == MAX_SCHEMA_DEPTH + 1
    for form in (deep, json.dumps(deep), _nested_arrays(500), "[" * 100_000):
        with pytest.raises(ValueError, match="structured_outputs.json"):
            StructuredOutputsParams(json=form)
    StructuredOutputsParams(json=_nested_arrays(MAX_SCHEMA_DEPTH))  # at the limit: served


# Each keyword below was measured: xgrammar 0.2.9 compiled the schema and accepted an output
# breaking it.
@pytest.mark.parametrize("schema, keyword", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems at /"),
    ({"type": "array", "contains": {"const": 5}}, "contains at /"),
    ({"not": {"type": "integer"}}, "not at /"),
    ({"if": {"type": "integer"}, "then": {"minimum": 5}}, "if at /"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired at /"),
    ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "allOf"),
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": "^a+$",
                                             "maxLength": 2}}},
     "minLength/maxLength (bound the length in a pattern instead) at /properties/s"),
    # alone, the bounded string admitted raw control characters: 10 of 30 outputs not JSON
    ({"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}}},
     "minLength/maxLength (bound the length in a pattern instead) at /properties/s"),
    ({"type": "string", "format": "date", "minLength": 20}, "pattern instead) at /"),
    ({"type": "number", "multipleOf": 0.25}, "whole multiple) at /"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "zz"]},
     "required names not in properties (zz) at /"),
    ({"type": "object", "$defs": {"t": {"type": "array", "uniqueItems": True}},
      "properties": {"t": {"$ref": "#/$defs/t"}}}, "uniqueItems at /$defs/t"),
    # helper-39: the grammar allowed only {} (strict objects hold only listed properties)
    ({"type": "object", "required": ["a"]}, "required names not in properties (a) at /"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "dependencies": {"a": ["b"]}},
     "dependencies at /"),
    # beside $ref / anyOf / oneOf / allOf / enum / const, xgrammar drops every other constraint
    ({"$ref": "#/$defs/x", "maximum": 5, "$defs": {"x": {"type": "integer"}}},
     "maximum beside $ref"),
    ({"allOf": [{"type": "integer"}], "maximum": 3}, "maximum beside allOf"),
    ({"anyOf": [{"type": "integer"}], "minimum": 5}, "minimum beside anyOf"),
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "anyOf": [{"required": ["a"]}]}, "properties beside anyOf"),
    ({"type": "string", "enum": ["a", "b"], "pattern": "^a$"}, "pattern beside enum"),
    ({"type": "integer", "enum": [1, 2], "maximum": 1}, "maximum beside enum"),
    ({"type": "string", "enum": [1, "a"]}, "type beside enum"),
    ({"type": "integer", "const": 1.5}, "type beside const"),
    ({"const": "ab", "pattern": "^a$"}, "pattern beside const"),
    ({"enum": ["a"], "anyOf": [{"type": "string"}]}, "anyOf and enum together"),
    # served as anyOf: "yes" matched both branches
    ({"oneOf": [{"enum": ["yes", "no"]}, {"type": "string"}]}, "oneOf whose branches may"),
    ({"oneOf": [{"type": "integer", "minimum": 3}, {"type": "number", "maximum": 5}]},
     "oneOf whose branches may"),
    ({"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
                {"type": "object", "properties": {"k": {"enum": ["b", "a"]}},
                 "required": ["k"]}]}, "oneOf whose branches may"),
])
def test_keywords_the_grammar_does_not_enforce_are_refused_naming_them(schema, keyword):
    with pytest.raises(ValueError, match="structured_outputs.json uses JSON Schema keywords") as e:
        check_structured_outputs(StructuredOutputsParams(json=schema))
    assert keyword in str(e.value)


def test_keyword_names_as_data_and_annotation_only_all_of_are_served():
    """Property names and enum values are data, not keywords; an allOf whose other members only
    describe adds no constraint, nor do annotations and definitions beside it (pydantic writes
    such schemas)."""
    schema = {"type": "object", "properties": {"not": {"type": "string"}, "contains": {
        "enum": [{"uniqueItems": True}], "type": "object"}, "c": {
            "allOf": [{"$ref": "#/$defs/c"}, {"description": "d"}], "title": "C"}},
        "required": ["not"], "$defs": {"c": {"type": "integer"}}}
    assert unenforced_keywords(schema) == []
    check_structured_outputs(StructuredOutputsParams(json=schema))


def test_pydantic_schemas_are_served():
    """What pydantic writes: a $ref or an enum with annotations beside it, Optional as anyOf with
    null, a discriminated union as a oneOf of $refs tagged by a Literal, recursion."""
    from typing import Annotated, Literal

    from pydantic import BaseModel, Field

    class Cat(BaseModel):
        kind: Literal["cat"]
        lives: int

    class Dog(BaseModel):
        kind: Literal["dog"]
        bark: str = Field(pattern="^w+$")

    class Node(BaseModel):
        value: int
        children: list["Node"] = []

    class Meow(BaseModel):  # a tag with a default is not required: the other fields decide
        sound: Literal["meow"] = "meow"
        lives: int

    class Woof(BaseModel):
        sound: Literal["woof"] = "woof"
        bark: str

    class Pet(BaseModel):
        name: str | None = None
        tag: Literal["a", "b"] = "a"
        pet: Annotated[Cat | Dog, Field(discriminator="kind")]
        either: Cat | Dog
        tagged_by_default: Annotated[Meow | Woof, Field(discriminator="sound")]
        number: int | str
        node: Node

    schema = Pet.model_json_schema()
    assert unenforced_keywords(schema) == []
    check_structured_outputs(StructuredOutputsParams(json=schema))


def test_keys_that_assert_nothing_are_served_beside_a_ref():
    """Unknown keywords constrain nothing (validators ignore them): OpenAPI's nullable, x-
    extensions and annotations beside a $ref or an enum are no dropped constraint."""
    schema = {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/x", "nullable": True, "x-order": 1, "description": "d"},
        "b": {"enum": ["p", "q"], "x-enum-names": ["P", "Q"], "title": "B"}},
        "$defs": {"x": {"type": "integer"}}}
    assert unenforced_keywords(schema) == []


def _closed(*required):
    return {"type": "object", "properties": {p: {"type": "integer"} for p in required},
            "required": list(required), "additionalProperties": False}


@pytest.mark.parametrize("schema", [
    {"oneOf": [{"const": "a"}, {"const": "b"}]},
    {"oneOf": [{"type": "string", "enum": ["a", "b"]}, {"enum": ["c", 1]}]},
    # MCP's titled enum: a "type" every branch has
    {"type": "string", "oneOf": [{"const": "#FF0000", "title": "Red"},
                                 {"const": "#00FF00", "title": "Green"}]},
    {"type": "object", "oneOf": [_closed("a"), _closed("b")]},
    {"$ref": "#/$defs/A", "type": "object", "$defs": {"A": _closed("a")}},
    {"type": ["object", "null"], "anyOf": [_closed("a"), {"type": "null"}]},
    # a union of unions, each tagged
    {"oneOf": [{"oneOf": [{"$ref": "#/$defs/B"}, {"$ref": "#/$defs/W"}]}, _closed("d")],
     "$defs": {c: {"type": "object", "properties": {"color": {"const": c}, "n": {}},
                   "required": ["color"]} for c in ("B", "W")}},
])
def test_unions_that_cannot_overlap_are_served(schema):
    """Refused by the first cut of the overlap rule (helper-44): consts and enums without a
    common value, a type every branch has, objects each requiring what the other lacks."""
    assert unenforced_keywords(schema) == [], schema


def test_one_of_served_where_no_value_can_match_two_branches():
    """Distinct types (integer and number overlap) or a required tag whose values differ."""
    tagged = [{"type": "object", "properties": {"k": {"const": k}, "v": {"type": "integer"}},
               "required": ["k"]} for k in ("a", "b")]
    for branches in ([{"type": "integer"}, {"type": "string"}, {"type": "null"}], tagged,
                     [{"$ref": "#/$defs/x"}, {"type": "string"}]):
        schema = {"oneOf": branches, "$defs": {"x": {"type": "array"}}}
        assert unenforced_keywords(schema) == [], branches


@pytest.mark.parametrize("regex, problem", [
    (r"\d{2}\Z", r"\Z"), (r"\Aab", r"\A"), ("a$b", "$ inside the pattern"),
    ("a^b", "^ inside the pattern")])
def test_anchors_the_grammar_misreads_are_refused(regex, problem):
    """xgrammar took \\Z as the letter Z (91Z) and dropped a $ inside (a$b gave "ab"), all
    finishing as `stop`; anchors where they change nothing are served."""
    with pytest.raises(ValueError, match="structured_outputs.regex has") as e:
        check_structured_outputs(StructuredOutputsParams(regex=regex))
    assert problem in str(e.value)
    with pytest.raises(ValueError, match="pattern with"):
        check_structured_outputs(StructuredOutputsParams(json={"type": "string",
                                                               "pattern": regex}))
    for fine in ("^a$", "^a|^b", "(^a|b$)", "[$^]x", r"\$x", "(?:^a)b"):
        check_structured_outputs(StructuredOutputsParams(regex=fine))


def test_values_that_are_no_json_name_the_field():
    """A set inside a schema, or a misspelt key of the dict form, were TypeErrors from deep
    inside building the grammar."""
    with pytest.raises(ValueError, match="structured_outputs.json must hold JSON values only"):
        StructuredOutputsParams(json={"type": "string", "enum": {"a"}})
    with pytest.raises(ValueError, match=r"structured_outputs must be a dict of .*\['jsn'\]"):
        SamplingParams(structured_outputs={"jsn": {"type": "object"}})


def test_disable_any_whitespace_keeps_jsons_item_separators():
    """What docs/structured-outputs.md says of --structured-outputs-config's disable_any_whitespace: the
    optional whitespace goes, and items are still joined by ", " and ": "."""
    from transformers import AutoTokenizer

    from kiln.structured_output.xgrammar_backend import XgrammarBackend

    from checkpoints import STORIES_DIR

    tokenizer = AutoTokenizer.from_pretrained(STORIES_DIR)
    backend = XgrammarBackend(tokenizer, len(tokenizer))
    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "b": {"type": "integer"}},
              "required": ["a", "b"], "additionalProperties": False}
    grammar = backend.compile(grammar_spec(StructuredOutputsParams(
        json=schema, disable_any_whitespace=True)))

    def accepts(text: str) -> bool:
        matcher = backend.matcher(grammar, [tokenizer.eos_token_id])
        return (matcher.accept_string(text) and matcher.accept_token(tokenizer.eos_token_id)
                and matcher.is_terminated())

    assert accepts('{"a": 1, "b": 2}')
    assert not accepts('{"a":1,"b":2}') and not accepts('{ "a": 1, "b": 2 }')
