"""OpenAI's documented limits on free-form request fields, refused with a 400 naming the field
as OpenAI's API refuses them: `metadata` (at most 16 string pairs, keys up to 64 characters,
values up to 512) and a json_schema format's `name` (a-z, A-Z, 0-9, _ and -, up to 64)."""
import re

from kiln.entrypoints.openai.errors import OpenAIError

METADATA_MAX_PAIRS = 16
METADATA_MAX_KEY_CHARS = 64
METADATA_MAX_VALUE_CHARS = 512
FORMAT_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
_FORMAT_NAME = re.compile(FORMAT_NAME_PATTERN)

# The same limits in the request models' JSON schema (/openapi.json), so that clients and schema
# tools see them: the checks below are what enforces them, with OpenAI's messages.
METADATA_SCHEMA = {"maxProperties": METADATA_MAX_PAIRS,
                   "propertyNames": {"maxLength": METADATA_MAX_KEY_CHARS},
                   "additionalProperties": {"type": "string",
                                            "maxLength": METADATA_MAX_VALUE_CHARS}}
FORMAT_NAME_SCHEMA = {"pattern": FORMAT_NAME_PATTERN}


def check_metadata(metadata: dict | None, param: str = "metadata") -> None:
    """`metadata` within OpenAI's limits (the body's types are checked before: strings)."""
    if metadata is None:
        return
    if len(metadata) > METADATA_MAX_PAIRS:
        raise OpenAIError(f"{param}: at most {METADATA_MAX_PAIRS} key-value pairs, got "
                          f"{len(metadata)}", param=param, code="invalid_value")
    for key, value in metadata.items():
        if len(key) > METADATA_MAX_KEY_CHARS:
            raise OpenAIError(f"{param}: a key is at most {METADATA_MAX_KEY_CHARS} characters, "
                              f"got {len(key)} ({key[:20]!r}...)", param=param,
                              code="invalid_value")
        if len(value) > METADATA_MAX_VALUE_CHARS:
            raise OpenAIError(f"{param}[{key!r}]: a value is at most {METADATA_MAX_VALUE_CHARS} "
                              f"characters, got {len(value)}", param=f"{param}.{key}",
                              code="invalid_value")


def check_format_name(name, param: str, nullable: bool = True) -> None:
    """A json_schema format's `name`, when given: a string of OpenAI's pattern
    ^[a-zA-Z0-9_-]{1,64}$ (vLLM types it as a string; it named nothing in the constraint).
    `nullable`: null counts as not given (text.format's name, typed string | null)."""
    if name is None and nullable:
        return
    if not isinstance(name, str):
        raise OpenAIError(f"{param}: must be a string, got {type(name).__name__} {name!r}",
                          param=param, code="invalid_type")
    if not _FORMAT_NAME.match(name):
        shown = name if len(name) <= 80 else name[:77] + "..."
        raise OpenAIError(f"{param}: must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -, got "
                          f"{shown!r}", param=param, code="invalid_value")
