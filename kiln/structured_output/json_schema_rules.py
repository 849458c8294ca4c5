"""What a JSON schema may hold to be served: keywords xgrammar compiles but does not enforce, and
a nesting limit. A schema outside them is refused (a 400 naming the field), not served outputs
that break it."""
import re

from kiln.structured_output.schema_union import (
    implied_types,
    one_of_may_overlap,
    types_of,
    values_of,
    within,
)

# Deeper schemas took seconds to check (the compile grows with the cube of the depth) and
# overflowed Python's recursion copying the request (a 500): no real schema comes near.
MAX_SCHEMA_DEPTH = 100

# Keywords that only describe: an allOf member made of these adds no constraint.
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated",
                "readOnly", "writeOnly"}
# Where a node has one of these, xgrammar compiles it alone and drops every other constraint
# written beside it (measured: {"$ref": ..., "type": "string"} took an integer, an anyOf
# beside "properties" took any object); a node may still hold definitions and annotations.
_EXCLUSIVE = ("$ref", "anyOf", "oneOf", "allOf", "enum", "const")
# The keywords that constrain a value: beside an exclusive one, each is dropped. Any other key
# (annotations, definitions, OpenAPI's "nullable" or "discriminator", "x-" extensions) asserts
# nothing, as JSON Schema validators ignore unknown keywords.
_ASSERTIONS = {"type", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
               "maxLength", "minLength", "pattern", "format", "maxItems", "minItems",
               "uniqueItems", "maxContains", "minContains", "maxProperties", "minProperties",
               "required", "dependentRequired", "dependencies", "properties",
               "patternProperties", "additionalProperties", "items", "prefixItems",
               "additionalItems", "contains", "propertyNames", "unevaluatedItems",
               "unevaluatedProperties", "not", "if", "then", "else", "dependentSchemas"}
# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_ONE = ("additionalProperties", "items", "additionalItems", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "contains", "not", "if", "then", "else")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def regex_anchor_problem(regex: str) -> str | None:
    """What xgrammar would misread in `regex` (it matches the whole output anyway): \\A, \\Z
    and \\z become letters, and a ^ or $ inside a branch is dropped (a$b gave "ab")."""
    i, in_class = 0, False
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            if not in_class and regex[i + 1:i + 2] in ("A", "Z", "z"):
                return f"\\{regex[i + 1]}"
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            i += 1 + (regex[i + 1:i + 2] == "^")
            i += regex[i:i + 1] == "]"  # a ] first in a class is the character
            continue
        elif c == "^" and not (i == 0 or regex[i - 1] in "(|" or regex[:i].endswith("(?:")):
            return "^ inside the pattern"
        elif c == "$" and i + 1 < len(regex) and regex[i + 1] not in ")|":
            return "$ inside the pattern"
        i += 1
    return None


def schema_depth(value) -> int:
    """How deep objects and arrays nest in `value` (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(
            node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _type_implied(node: dict, root) -> bool:
    """A "type" beside an enum, const, $ref, anyOf or oneOf that every value they allow already
    has changes nothing (pydantic writes {"enum": [...], "type": "string"}; OpenAPI writes
    "type": "object" beside a oneOf of objects)."""
    allowed = node["type"] if isinstance(node["type"], list) else [node["type"]]
    rest = {k: v for k, v in node.items() if k != "type"}
    if "allOf" in rest:
        return False
    kinds = types_of(rest) if values_of(rest) is not None else implied_types(rest, root)
    return kinds is not None and within(kinds, set(allowed))


def _dropped_beside(node: dict, root) -> list[str]:
    """Constraints beside an exclusive keyword, which xgrammar drops."""
    exclusive = [k for k in _EXCLUSIVE if k in node]
    if not exclusive:
        return []
    found = []
    if len(exclusive) > 1 and exclusive != ["enum", "const"]:
        found.append(f"{' and '.join(exclusive)} together (only one is enforced)")
    for key in node:
        if key not in _ASSERTIONS:
            continue
        if key == "type" and len(exclusive) == 1 and _type_implied(node, root):
            continue
        found.append(f"{key} beside {exclusive[0]} (only the {exclusive[0]} is enforced)")
    return found


def _unenforced(node: dict, root) -> list[str]:
    """The keywords of one schema node that xgrammar 0.2 compiles without enforcing (each
    measured: an output breaking it was accepted)."""
    found = [k for k in ("contains", "minContains", "maxContains", "not", "if", "then", "else",
                         "dependentRequired", "dependentSchemas", "dependencies") if k in node]
    found += _dropped_beside(node, root)
    found += _object_keys_unchecked(node)
    one_of = node.get("oneOf")
    if isinstance(one_of, list) and one_of_may_overlap(one_of, root):
        found.append("oneOf whose branches may overlap (served as anyOf: use anyOf, or give "
                     "each branch its own type or a const tag)")
    if node.get("uniqueItems") is True:
        found.append("uniqueItems")
    all_of = node.get("allOf")
    if isinstance(all_of, list) and sum(
            1 for m in all_of if not (isinstance(m, dict) and set(m) <= _ANNOTATIONS)) > 1:
        found.append("allOf (of more than one schema)")
    if "minLength" in node or "maxLength" in node:
        # With a pattern or a format the lengths are dropped; alone, xgrammar's length-bounded
        # string lets raw control characters in (outputs that are not JSON). A pattern bounds
        # a length instead: "^[a-z]{0,8}$".
        found.append("minLength/maxLength (bound the length in a pattern instead)")
    pattern = node.get("pattern")
    problem = regex_anchor_problem(pattern) if isinstance(pattern, str) else None
    if problem is not None:
        found.append(f"pattern with {problem} (misread: the pattern matches the whole string)")
    multiple = node.get("multipleOf")
    if multiple is not None and not (node.get("type") == "integer" and isinstance(
            multiple, (int, float)) and float(multiple).is_integer()):
        found.append("multipleOf (enforced only as an integer's whole multiple)")
    required, properties = node.get("required"), node.get("properties")
    if isinstance(required, list) and not any(k in node for k in _EXCLUSIVE):
        properties = properties if isinstance(properties, dict) else {}
        missing = [name for name in required if name not in properties]
        if missing:  # never written: the grammar allows only the listed properties
            found.append(f"required names not in properties ({', '.join(map(str, missing))})")
    return found


def _may_match(pattern, name: str) -> bool:
    """Whether a property-name pattern may match `name` (one Python cannot read: it may)."""
    try:
        return re.search(pattern, name) is not None
    except (re.error, TypeError):
        return True


def _object_keys_unchecked(node: dict) -> list[str]:
    """Where xgrammar 0.2.9 writes an object's keys unchecked against each other (each measured:
    an output breaking the schema was accepted, and a default-model server wrote some). Keys
    allowed by additionalProperties, patternProperties or propertyNames may repeat (a repeated
    key counts twice toward minProperties) and, beside properties, may be a declared name:
    {"a": "x"} where properties said a is an integer. A $ref that is not local ("#/...")
    is not followed: any value passes."""
    found = []
    ref = node.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        found.append(f"$ref {ref!r} (only local '#/...' references are followed: "
                     "any value would pass)")
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    patterns = node.get("patternProperties")
    patterns = patterns if isinstance(patterns, dict) else {}
    extra = any(key in node and node[key] is not False
                for key in ("additionalProperties", "unevaluatedProperties"))
    if patterns and props and (extra or any(_may_match(p, n) for p in patterns for n in props)):
        found.append("patternProperties beside properties (a declared property could be "
                     "written with another schema)")
    names = node.get("propertyNames")
    if "propertyNames" in node and props and (extra or not (
            isinstance(names, dict) and set(names) - _ANNOTATIONS == {"pattern"}
            and all(_may_match(names["pattern"], n) for n in props))):
        found.append("propertyNames beside properties (a declared property could be written "
                     "with another schema, or against the names' pattern)")
    least = node.get("minProperties")
    if (isinstance(least, (int, float)) and not isinstance(least, bool) and least > 1
            and (extra or patterns or "propertyNames" in node)):
        found.append("minProperties over keys not listed in properties (a key may repeat "
                     "and count twice)")
    return found


def unenforced_keywords(schema) -> list[str]:
    """'keyword at /json/pointer' for every keyword of the schema xgrammar would not enforce.
    Walks subschemas only: property names and enum / const values are data, not keywords."""
    found, stack = [], [(schema, "")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        found.extend(f"{k} at {path or '/'}" for k in _unenforced(node, schema))
        for key in _ONE:
            if isinstance(node.get(key), dict):
                stack.append((node[key], f"{path}/{key}"))
        for key in _LIST:
            if isinstance(node.get(key), list):
                stack.extend((sub, f"{path}/{key}/{i}") for i, sub in enumerate(node[key]))
        for key in _MAP:
            if isinstance(node.get(key), dict):
                stack.extend((sub, f"{path}/{key}/{name}") for name, sub in node[key].items())
    return sorted(found)
