"""vLLM's structural tags (xgrammar's): the object a request gives, its legacy form's shape, and
the JSON schemas and regexes inside it, which get the checks a json or regex constraint gets."""
import json

# Format types whose "json_schema" is a JSON schema the tag's grammar writes (xgrammar's).
_SCHEMA_FORMATS = ("json_schema", "qwen_xml_parameter")


def tag_object(value) -> dict:
    """The structural tag as a dict, from its JSON text or the dict itself; ValueError (without
    the field's name: the caller adds it) where it is neither."""
    tag = value
    if isinstance(value, str):
        try:
            tag = json.loads(value)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"is not valid JSON: {e}") from None
    if not isinstance(tag, dict):
        raise ValueError(f"must be a JSON object (a structural tag), got {type(tag).__name__}")
    return tag


def is_legacy(tag: dict) -> bool:
    """vLLM's first form: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}, the
    current one {"format": {...}}."""
    return "structures" in tag


def legacy_problem(tag: dict) -> str | None:
    """What is wrong with a legacy tag's shape, "<key> must be ..." (the caller names the field
    before it), read before xgrammar's conversion meets it as a KeyError; None: nothing."""
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not all(
            isinstance(s, dict) and isinstance(s.get("begin"), str) and s["begin"]
            and isinstance(s.get("end"), str) and isinstance(s.get("schema"), dict)
            for s in structures):
        return ("structures must be a list of objects, each with a non-empty string begin, a "
                "JSON schema (an object) and a string end")
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        return "triggers must be a list of non-empty strings"
    return None


def inner_constraints(tag: dict) -> tuple[list[tuple[str, dict]], list[tuple[str, str]]]:
    """The tag's JSON schemas and regex patterns, each with its JSON pointer in the tag. Walks
    formats only: a schema is data, searched no further."""
    if is_legacy(tag):
        return [(f"/structures/{i}/schema", s["schema"])
                for i, s in enumerate(tag.get("structures") or ())
                if isinstance(s, dict) and isinstance(s.get("schema"), dict)], []
    schemas, regexes, stack = [], [], [(tag, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, list):
            stack.extend((item, f"{path}/{i}") for i, item in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        if kind in _SCHEMA_FORMATS and isinstance(node.get("json_schema"), dict):
            schemas.append((f"{path}/json_schema", node["json_schema"]))
        if kind == "regex" and isinstance(node.get("pattern"), str):
            regexes.append((f"{path}/pattern", node["pattern"]))
        stack.extend((child, f"{path}/{key}") for key, child in node.items()
                     if key != "json_schema" and isinstance(child, (dict, list)))
    return sorted(schemas, key=lambda s: s[0]), sorted(regexes)
