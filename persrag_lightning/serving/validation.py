"""What the chat service refuses and how it says so: `ServiceError` (an HTTP 4xx with a one-line
message), and `parse`, which validates a request body against its pydantic model
(serving/requests.py) and turns the first fault into that one line, naming the field: `field
`messages[0].content` has 9001 characters, more than the limit of 8000`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from persrag_lightning.serving.requests import PATTERN_MEANINGS

__all__ = ["ServiceError", "bad_request", "field_path", "is_utf8", "parse", "refusal"]

ModelT = TypeVar("ModelT", bound=BaseModel)

# how a failed constraint reads after "field `x` ": pydantic's error types, in the service's words
PHRASES = {
    "missing": "is required",
    "string_too_short": "must not be empty",
    "too_short": "must not be empty",
    "string_unicode": "is not valid UTF-8 text (a lone surrogate)",
    "string_type": "must be text",
    "bool_type": "must be true or false",
    "list_type": "must be a list",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
}


class ServiceError(Exception):
    """A request the service refuses, answered as `{"error": {"message", "status"}}`.

    Args:
        status: the HTTP status, a 4xx.
        message: one line saying why, naming the field at fault.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def bad_request(message: str) -> ServiceError:
    return ServiceError(400, message)


def is_utf8(text: str) -> bool:
    """False for text no file or response can hold (a lone surrogate, as JSON's "\\ud800" decodes
    to)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse(model: type[ModelT], body: Mapping | ModelT) -> ModelT:
    """`body` validated against `model` (a model instance passes as it is), or the ServiceError of
    its fault."""
    if isinstance(body, model):
        return body
    if not isinstance(body, Mapping):
        raise bad_request(f"body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(dict(body))
    except ValidationError as e:
        raise refusal(e.errors(include_url=False)) from None


def refusal(errors: list[ErrorDetails]) -> ServiceError:
    """The one error a client is told: a list over its size cap (413, as a body over its byte cap)
    before any other, else the first in the body's order."""
    too_big = [e for e in errors if e["type"] == "too_long" and e["loc"] == ("history",)]
    error = (too_big or errors)[0]
    loc, ctx, kind = error["loc"], error.get("ctx") or {}, error["type"]
    path = field_path(loc[:-2] if loc[-1:] == ("[key]",) else loc)
    subject = f"a field name of `{path}`" if loc[-1:] == ("[key]",) else f"field `{path}`" if path else "body"
    if kind == "too_long":
        what = "docs" if too_big else "items"
        message = f"{subject} has {ctx.get('actual_length')} {what}, more than the limit of {ctx.get('max_length')}"
        return ServiceError(413 if too_big else 400, message)
    if kind == "string_too_long":
        message = (f"has {len(error['input'])} characters, more than the limit of {ctx['max_length']}"
                   if isinstance(error["input"], str) else f"has more than {ctx['max_length']} characters")
    elif kind == "string_pattern_mismatch":
        message = PATTERN_MEANINGS.get(ctx.get("pattern", ""), f"must match {ctx.get('pattern')!r}")
    elif kind == "literal_error":
        message = f"must be one of {ctx.get('expected')}"
    elif kind in PHRASES:
        message = PHRASES[kind]
        if kind.endswith("_type"):
            message += f", got {type(error['input']).__name__}"
    # the models' own checks (a rule across fields, a known category): their message says it all
    else:
        return bad_request(f"{subject}: {error['msg']}" if path else error["msg"])
    return bad_request(f"{subject} {message}")


def field_path(loc: tuple[int | str, ...]) -> str:
    """("history", 0, "fields", "genre") → `history[0].fields.genre`; a name that is no identifier
    is quoted, so the message stays one line."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.isidentifier():
            out += f"[{part!r}]"
        else:
            out += f".{part}" if out else part
    return out

