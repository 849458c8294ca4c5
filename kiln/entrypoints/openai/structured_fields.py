"""A request's structured-output fields (response_format, structured_outputs, guided_*) as one
`StructuredOutputsParams`, every error a 400 naming the field the client sent.
"""
import asyncio
import re

from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.openai_limits import check_format_name
from kiln.sampling_params import StructuredOutputsParams
from kiln.structured_output.params import (
    STRUCTURED_OUTPUT_KEYWORDS,
    TAKEN_STRUCTURED_OUTPUT_KEYWORDS,
)

# vLLM's older names -> the StructuredOutputsParams field they set.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar", "structural_tag": "structural_tag"}
# The request fields that each constrain the output: at most one may (openapi.py says so too).
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", *_GUIDED)


def _from_response_format(fmt) -> dict | None:
    if fmt is not None and fmt.json_schema and "name" in fmt.json_schema:
        # whatever the type, as the request's schema says (a string, null too refused)
        check_format_name(fmt.json_schema["name"], "response_format.json_schema.name",
                          nullable=False)
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.type == "structural_tag":
        return {"structural_tag": _structural_tag(fmt)}
    spec = fmt.json_schema or {}
    schema = spec.get("schema")
    if schema is None:  # OpenAI requires one; vLLM reads its absence as any JSON object
        return {"json_object": True}
    return {"json": schema}


def _structural_tag(fmt) -> dict:
    """vLLM's response_format of type structural_tag as the tag it stands for: xgrammar's
    format, or the legacy structures and triggers (one of the two forms)."""
    legacy = {k: getattr(fmt, k) for k in ("structures", "triggers") if getattr(fmt, k) is not None}
    if (fmt.format is None) == (not legacy):
        raise OpenAIError("response_format of type structural_tag takes format (a structural "
                          "tag's format object) or vLLM's legacy structures and triggers, "
                          f"one of the two; got {'both' if legacy else 'neither'}",
                          param="response_format", code="invalid_value")
    if fmt.format is not None:
        return {"type": "structural_tag", "format": fmt.format}
    return {"type": "structural_tag", "structures": legacy.get("structures"),
            "triggers": legacy.get("triggers")}


def request_structured_outputs(req, disable_any_whitespace: bool = False
                               ) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the constraint, the request field it came from); (None, None) when there is none.
    More than one source (e.g. response_format and structured_outputs) is refused.
    `disable_any_whitespace`: the server's default (--structured-outputs-config) where the
    request does not say."""
    sources: list[tuple[str, dict]] = []
    fmt = _from_response_format(req.response_format)
    if fmt is not None:
        sources.append(("response_format", fmt))
    if req.structured_outputs is not None:
        sources.append(("structured_outputs", dict(req.structured_outputs)))
    for name, kind in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            sources.append((name, {kind: value}))
    if not sources:
        return None, None
    if len(sources) > 1:
        names = [n for n, _ in sources]
        raise OpenAIError(f"{' and '.join(names)} each constrain the output: give one of them",
                          param=names[1], code="invalid_value")
    field, fields = sources[0]
    fields.setdefault("disable_any_whitespace", disable_any_whitespace)
    return build_params(fields, field), field


def parse_structured_outputs_config(text: str | None) -> bool:
    """--structured-outputs-config '{"disable_any_whitespace": true}' (vLLM's flag; the one
    key this server reads) -> the server's default disable_any_whitespace."""
    import json

    if text is None:
        return False
    try:
        config = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--structured-outputs-config is not JSON: {e}") from None
    if not isinstance(config, dict) or set(config) - {"disable_any_whitespace", "backend"}:
        raise ValueError("--structured-outputs-config takes a JSON object with "
                         f"disable_any_whitespace (and backend \"xgrammar\"), got {text!r}")
    if config.get("backend", "xgrammar") not in ("xgrammar", "auto"):
        raise ValueError(f"--structured-outputs-config backend {config['backend']!r}: this "
                         "server compiles grammars with xgrammar only")
    value = config.get("disable_any_whitespace", False)
    if not isinstance(value, bool):
        raise ValueError("--structured-outputs-config disable_any_whitespace must be true or "
                         f"false, got {value!r}")
    return value


# Set by the server alone, from --reasoning-parser: a client's marker that the model never
# writes would leave the output unconstrained, yet finished "stop".
_SERVER_SET = ("reasoning_end",)


def build_params(fields: dict, param: str) -> StructuredOutputsParams:
    known = sorted(TAKEN_STRUCTURED_OUTPUT_KEYWORDS - set(_SERVER_SET))
    # (vLLM's fields this server does not take are refused below, saying why)
    unknown = sorted(set(fields) - (STRUCTURED_OUTPUT_KEYWORDS - set(_SERVER_SET)))
    if unknown:
        raise OpenAIError(f"{param} has unknown field(s) {unknown}; known: {known}",
                          param=param, code="invalid_value")
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as e:
        raise OpenAIError(_in_terms_of(str(e), param), param=param,
                          code="invalid_value") from None


# The engine names what it compiles structured_outputs.X; under a forced tool_choice that is a
# schema made of the tools' parameters, a field the client never sent.
_COMPILED_AS = {"tools": "the schema of the tools' parameters"}
# ...where tool_choice "required" puts tool i's parameters at /$defs/kiln_tool_i (forced.py): a
# place in it is named as the client wrote it, tools[i].function.parameters.
_TOOL_DEFS = re.compile(r"(#?)/\$defs/kiln_tool_(\d+)")


def _in_terms_of(message: str, param: str) -> str:
    """The engine names structured_outputs.X; the client may have sent response_format."""
    if param == "structured_outputs":
        return message
    if param in _COMPILED_AS:
        message = re.sub(r"^structured_outputs\.\w+", _COMPILED_AS[param], message)
    if param == "tools":
        message = _TOOL_DEFS.sub(r"tools[\2].function.parameters\1", message)
    return f"{param}: {message}"


def constraint_failure(message: str, param: str) -> OpenAIError:
    """The core's failure of a grammar it compiled ("structured_outputs.regex allows no token
    after 3 generated token(s)"), as a 400 naming the request field the constraint came from:
    the client may have sent guided_regex, response_format or tools."""
    return OpenAIError(_in_terms_of(message, param), param=param, code="request_failed")


async def check_compiles(params: StructuredOutputsParams, param: str) -> None:
    """400 naming `param` when the schema / regex / grammar does not parse. Off the event
    loop: the first call imports xgrammar."""
    from kiln.structured_output.xgrammar_backend import check_structured_outputs

    try:
        await asyncio.to_thread(check_structured_outputs, params)
    except ValueError as e:
        raise OpenAIError(_in_terms_of(str(e), param), param=param,
                          code="invalid_value") from None
