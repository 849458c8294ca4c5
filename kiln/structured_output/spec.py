"""`GrammarSpec`: what to compile for a request's StructuredOutputsParams, as a hashable key.

Pure: the grammar compiler's cache and the front end's validation both start from it.
"""
import json
from dataclasses import dataclass

from kiln.structured_output.params import StructuredOutputsParams


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # "json" | "json_object" | "regex" | "ebnf" | "lark" | "structural_tag"
    # the schema's or structural tag's JSON text, the regex or the grammar ("" for json_object)
    text: str
    any_whitespace: bool = True
    field: str = "structured_outputs.json"  # the request field it came from, for errors


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of the strings (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def grammar_spec(params: StructuredOutputsParams) -> GrammarSpec:
    kind = params.kind
    ws = not params.disable_any_whitespace
    if kind == "json":
        schema = params.json
        text = schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False)
        return GrammarSpec("json", text, ws, field="structured_outputs.json")
    if kind == "json_object":
        return GrammarSpec("json_object", "", ws, field="structured_outputs.json_object")
    if kind == "regex":
        return GrammarSpec("regex", params.regex, field="structured_outputs.regex")
    if kind == "choice":
        return GrammarSpec("ebnf", choice_ebnf(params.choice), field="structured_outputs.choice")
    if kind == "structural_tag":
        tag = params.structural_tag
        text = tag if isinstance(tag, str) else json.dumps(tag, ensure_ascii=False)
        return GrammarSpec("structural_tag", text, field="structured_outputs.structural_tag")
    # vLLM's rule: EBNF (GBNF) has `::=` rules; anything else is read as Lark.
    grammar = params.grammar
    return GrammarSpec("ebnf" if "::=" in grammar else "lark", grammar,
                       field="structured_outputs.grammar")
