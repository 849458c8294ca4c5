"""The base every request and response model shares (unknown fields ignored, an explicit null taken
as the default) and the JSON field types requests are built from: numbers, token ids.
"""
from typing import Annotated, ClassVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetPydanticSchema,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import core_schema

_MODEL_CONFIG = ConfigDict(extra="ignore", protected_namespaces=())


class OpenAIBase(BaseModel):
    model_config = _MODEL_CONFIG
    # Fields whose null means something of its own, not the default.
    null_kept: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        """An explicit null takes the field's default, as OpenAI and vLLM treat it (clients
        send `"n": null`); a required field stays required."""
        if isinstance(data, dict) and None in data.values():
            return {k: v for k, v in data.items()
                    if v is not None or k not in cls.model_fields
                    or cls.model_fields[k].is_required() or k in cls.null_kept}
        return data


def _json_number(value):
    """JSON numbers only: true is no 1 and "5" no 5 (pydantic's lax mode takes both), while
    an integral 5.0 stays the integer JSON Schema says it is."""
    if isinstance(value, (bool, str, bytes)):
        raise ValueError("must be a JSON number")
    return value


# Request fields: types as /openapi.json says them.
JsonInt = Annotated[int, BeforeValidator(_json_number)]
JsonFloat = Annotated[float, BeforeValidator(_json_number)]


def _integral(value: float) -> int:
    if not value.is_integer() or abs(value) >= 2**63:
        raise ValueError("not an integer")
    return int(value)


def _token_id_schema(_source, _handler) -> core_schema.CoreSchema:
    """An int, or an integral float such as 5.0 (what JsonInt takes, ints past int64 aside),
    checked in pydantic's core: JsonInt's Python call per id held the event loop for 100 ms on
    a 4 MB body, every stream waiting. Only a float calls _integral; a refusal is one error."""
    return core_schema.union_schema(
        [core_schema.int_schema(strict=True),
         core_schema.no_info_after_validator_function(_integral,
                                                      core_schema.float_schema(strict=True))],
        custom_error_type="token_id_type", custom_error_message="must be an integer JSON number")


TokenId = Annotated[int, GetPydanticSchema(_token_id_schema), WithJsonSchema({"type": "integer"})]
# Lists of ids stop at their first bad one: a 600k-item list of floats otherwise built 600k
# errors on the event loop (seconds) before its 400 went out.
TokenIds = Annotated[list[TokenId], Field(fail_fast=True)]


class RequestBase(OpenAIBase):
    """Request bodies (their int, float and bool fields are JSON numbers and booleans)."""


class RequestPart(BaseModel):
    """Items of a request's lists, which a body may hold by the thousand (messages, content
    parts): as RequestBase, without the null-is-default rewrite, a Python call per item on the
    event loop. None of their optional fields defaults to anything but None, so it would change
    nothing (tests/server/test_big_bodies.py checks that)."""
    model_config = _MODEL_CONFIG


def warn_ignored_fields(logger, model_cls, data, no_effect: frozenset[str]) -> None:
    """Name what a request sent that no field of `model_cls` reads (vLLM's warning): a client
    that misspells a field otherwise sees its default at work without a word. `no_effect`:
    fields taken in silence (OpenAI's that change nothing a local model writes)."""
    if isinstance(data, dict) and (
            ignored := data.keys() - model_cls.model_fields.keys() - no_effect):
        logger.warning("request fields Kiln does not read, ignored: %s",
                       ", ".join(sorted(map(str, ignored))))
