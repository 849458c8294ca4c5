"""What the branches of a JSON schema union can be, for json_schema_rules.py: the JSON types and
values each allows, and whether two could take one value (a oneOf xgrammar serves as anyOf).

Values here are what the grammar writes: xgrammar compiles in strict mode, so an object it writes
for a branch holds only the properties that branch declares.
"""
import json

_WIDER = {"integer": {"number"}, "number": {"integer"}}  # 1 is both


def resolve(node, root, hops: int = 8):
    """A local "#/..." $ref followed (a few hops at most); anything else as it is."""
    while hops and isinstance(node, dict) and isinstance(node.get("$ref"), str) \
            and node["$ref"].startswith("#"):
        target = root
        for part in filter(None, node["$ref"][1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part) if isinstance(target, dict) else None
        if target is None:
            return node
        node, hops = target, hops - 1
    return node


def alternatives(node, root, depth: int = 8) -> list[dict] | None:
    """The schemas a value of `node` matches one of: $refs followed, anyOf / oneOf branches
    flattened; None where one is not a schema object."""
    node = resolve(node, root)
    if not isinstance(node, dict):
        return None
    branches = node.get("anyOf", node.get("oneOf"))
    if not (isinstance(branches, list) and branches and depth):
        return [node]
    out = []
    for branch in branches:
        leaves = alternatives(branch, root, depth - 1)
        if leaves is None:
            return None
        out.extend(leaves)
    return out


def json_type(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), "null")


def values_of(leaf: dict) -> set[str] | None:
    """The values a const / enum leaf allows (as canonical JSON); None for any other."""
    if "const" in leaf:
        return {json.dumps(leaf["const"], sort_keys=True)}
    if isinstance(leaf.get("enum"), list):
        return {json.dumps(v, sort_keys=True) for v in leaf["enum"]}
    return None


def types_of(leaf: dict) -> set[str] | None:
    """The JSON types a leaf allows; None where it says none (a schema without "type" matches
    every type). An integer value's type is "integer" (it is a "number" too)."""
    values = values_of(leaf)
    if values is not None:
        return {json_type(json.loads(v)) for v in values}
    if isinstance(leaf.get("type"), str):
        return {leaf["type"]}
    if isinstance(leaf.get("type"), list):
        return set(leaf["type"])
    return None


def implied_types(node, root) -> set[str] | None:
    """The JSON types every value of a $ref / anyOf / oneOf node has, where each branch says."""
    leaves = alternatives(node, root)
    if leaves is None:
        return None
    kinds = [types_of(leaf) for leaf in leaves]
    return None if any(k is None for k in kinds) else set().union(*kinds)


def within(kinds: set[str], allowed: set[str]) -> bool:
    """Whether values of types `kinds` all satisfy a "type" of `allowed`."""
    return kinds <= allowed | ({"integer"} if "number" in allowed else set())


def _tag_values(props: dict, name: str, root) -> set[str] | None:
    prop = resolve(props[name], root)
    return values_of(prop) if isinstance(prop, dict) else None


def _objects_disjoint(a: dict, b: dict, root) -> bool:
    """Two object leaves no value matches both of: a property one requires whose allowed values
    differ between them (a discriminator's tag), or each requires a property the other does not
    declare (an object written for one holds only its declared properties: it fails the
    other)."""
    props_a, props_b = a.get("properties") or {}, b.get("properties") or {}
    req_a, req_b = set(a.get("required") or ()), set(b.get("required") or ())
    for name in (req_a | req_b) & props_a.keys() & props_b.keys():
        va, vb = _tag_values(props_a, name, root), _tag_values(props_b, name, root)
        if va is not None and vb is not None and not va & vb:
            return True
    return bool(req_b - props_a.keys()) and bool(req_a - props_b.keys())


def leaves_disjoint(a: dict, b: dict, root) -> bool:
    va, vb = values_of(a), values_of(b)
    if va is not None and vb is not None:
        return not va & vb
    ta, tb = types_of(a), types_of(b)
    if ta is not None and tb is not None:
        widen = [k.union(*(_WIDER.get(t, set()) for t in k)) for k in (ta, tb)]
        if not widen[0] & widen[1]:
            return True
    return ta == tb == {"object"} and _objects_disjoint(a, b, root)


def one_of_may_overlap(branches: list, root) -> bool:
    """Whether two branches of a oneOf may both match a value the grammar writes."""
    leaves = [alternatives(b, root) for b in branches]
    if any(ls is None for ls in leaves):
        return True
    return any(not leaves_disjoint(a, b, root)
               for i in range(len(leaves)) for j in range(i + 1, len(leaves))
               for a in leaves[i] for b in leaves[j])
