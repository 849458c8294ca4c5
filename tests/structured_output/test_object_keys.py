"""Object keys xgrammar 0.2.9 writes unchecked: keys past `properties` (additionalProperties,
patternProperties, propertyNames) may repeat, counting twice toward minProperties, and beside
properties may be a declared name with another schema; a $ref that is not local is not
followed. Such schemas are refused naming the keyword; the shapes it does check are served."""
import json

import pytest

from kiln.sampling_params import StructuredOutputsParams
from kiln.structured_output.json_schema_rules import unenforced_keywords
from kiln.structured_output.xgrammar_backend import check_structured_outputs

jsonschema = pytest.importorskip("jsonschema")
xgr = pytest.importorskip("xgrammar")

INT = {"type": "integer"}

# schema, the keyword named, an output the grammar accepts that breaks the schema. A server on
# the default model wrote the first two ({"b": -1059, "b": -1} and {"a": -1}) at temperature 1.
REFUSED = [
    ({"type": "object", "propertyNames": {"pattern": "^[ab]$"},
      "additionalProperties": INT, "minProperties": 2}, "minProperties over",
     '{"b": 1, "b": 2}'),
    ({"type": "object", "properties": {"a": INT},
      "patternProperties": {"^[a-c]$": {"type": "integer", "minimum": 0}}},
     "patternProperties beside properties", '{"a": -1}'),
    ({"type": "object", "additionalProperties": True, "minProperties": 2}, "minProperties over",
     '{"a": 1, "a": 2}'),
    ({"type": "object", "properties": {"a": INT},
      "patternProperties": {"^x[0-9]$": {"type": "string"}},
      "additionalProperties": {"type": "string"}}, "patternProperties beside properties",
     '{"a": "x"}'),
    ({"type": "object", "properties": {"a": INT}, "propertyNames": {"pattern": "^[a-c]$"},
      "additionalProperties": {"type": "string"}}, "propertyNames beside properties",
     '{"a": "x"}'),
    ({"type": "object", "properties": {"zz": INT}, "propertyNames": {"pattern": "^[a-c]$"}},
     "propertyNames beside properties", '{"zz": 1}'),
    ({"$defs": {"x": {"$anchor": "foo", "type": "integer"}}, "$ref": "#foo"}, "$ref '#foo'",
     '"s"'),
]


def _accepts(schema: dict, text: str) -> bool:
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                           strict_mode=True)
    return _is_grammar_accept_string(grammar, text)


@pytest.mark.parametrize("schema, keyword, breaking", REFUSED)
def test_object_keys_the_grammar_does_not_check_are_refused(schema, keyword, breaking):
    # The measurement behind the refusal: the grammar takes an output the schema refuses.
    assert _accepts(schema, breaking)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(breaking), schema)
    with pytest.raises(ValueError, match="structured_outputs.json uses JSON Schema keywords") as e:
        check_structured_outputs(StructuredOutputsParams(json=schema))
    assert keyword in str(e.value)


def test_a_remote_ref_is_refused():
    with pytest.raises(ValueError, match=r"\$ref 'http://example.com/s.json' \(only local"):
        check_structured_outputs(StructuredOutputsParams(json={"$ref": "http://example.com/s.json"}))


@pytest.mark.parametrize("schema, rejected", [
    ({"type": "object", "properties": {"a": INT},
      "patternProperties": {"^x[0-9]$": {"type": "string"}}}, ['{"a": "x"}', '{"x1": 1}']),
    ({"type": "object", "properties": {"a": INT}, "propertyNames": {"pattern": "^[a-c]$"}},
     ['{"a": "x"}', '{"b": 1}']),
    ({"type": "object", "properties": {"a": INT, "b": INT}, "minProperties": 2},
     ['{"a": 1}', '{"a": 1, "a": 2}']),
    ({"type": "object", "additionalProperties": INT, "minProperties": 1}, ['{}']),
    ({"type": "object", "properties": {"k": {"$ref": "#"}}}, ['{"k": 1}']),
])
def test_object_keys_the_grammar_checks_are_served(schema, rejected):
    for text in rejected:
        assert not _accepts(schema, text), text
    assert unenforced_keywords(schema) == []
    check_structured_outputs(StructuredOutputsParams(json=schema))
