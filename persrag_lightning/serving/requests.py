"""The bodies `persrag serve` accepts, one pydantic model each: their limits are the ones the
service enforces (serving/validation.py parses every body with them) and the OpenAPI schema is
generated from them (serving/app.py), so the two cannot disagree.

Texts and ids refuse lone surrogates (JSON's "\\ud800" decodes to one, and no file or LanceDB
literal can hold it); pydantic does that for every `str`. Unknown fields are ignored, as OpenAI
clients send more than we read.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    create_model,
    model_validator,
)
from pydantic_core import PydanticCustomError

from persrag_lightning.data.lamp import DATE_PATTERN
from persrag_lightning.memory.extract import CATEGORIES
from persrag_lightning.memory.store import MAX_ID_CHARS

__all__ = [
    "MAX_DATE_CHARS", "MAX_FIELD_NAME_CHARS", "MAX_HISTORY_DOCS", "MAX_MESSAGES", "MAX_MESSAGE_CHARS",
    "MAX_MODEL_CHARS", "PATTERN_MEANINGS", "Answers", "Chat", "Error", "History", "HistoryDocBody", "Message", "Question",
    "SignUp", "Text",
]

# a message, an answer or a doc field (memory/bank.py's MemorySettings default)
MAX_MESSAGE_CHARS = 8000
MAX_HISTORY_DOCS = 200  # docs of one history (sign-up or replacement): more is a 413, encoded never
MAX_FIELD_NAME_CHARS = 64
MAX_DATE_CHARS = 64
MAX_MODEL_CHARS = 256
# turns of one request (OpenAI clients resend the conversation; the body's 1 MiB bounds it too)
MAX_MESSAGES = 1000

NO_CONTROL = r"^[^\x00-\x1f\x7f]+$"
# the router matches the decoded path: `a/b` could never be addressed
ADDRESSABLE = r"^[^/\x00-\x1f\x7f]+$"
# pydantic's regex (Rust) \s lacks \x1c-\x1f, which Python's str.strip() removes
NOT_BLANK = r"[^\s\x1c-\x1f]"
DATE = f"^{DATE_PATTERN}$"  # what data/lamp.py's parse_date reads
PATTERN_MEANINGS = {
    NO_CONTROL: "contains control characters",
    ADDRESSABLE: "contains control characters or a '/' (a URL path must be able to address it)",
    NOT_BLANK: "is empty",
    DATE: "must be a date: '-'-separated integers, as 2024-01-02",
}


def no_dot_segment(value: str) -> str:
    """Clients fold `.` and `..` out of a URL path: such a user could never be listed or deleted."""
    if value in (".", ".."):
        raise PydanticCustomError("dot_segment", "{value} cannot be addressed in a URL path (not '.' or '..')",
                                  {"value": repr(value)})
    return value


def int_as_text(value: object) -> object:
    """LaMP's doc ids are often numbers: 7 is the id "7" (a bool is no number here)."""
    return str(value) if type(value) is int else value


def no_streaming(value: bool | None) -> bool | None:
    if value:
        raise PydanticCustomError("streaming", "streaming is not supported; send stream: false")
    return value


Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS, pattern=NO_CONTROL)]
UserId = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS, pattern=ADDRESSABLE),
                   AfterValidator(no_dot_segment)]
Text = Annotated[str, Field(max_length=MAX_MESSAGE_CHARS, pattern=NOT_BLANK)]
FieldName = Annotated[str, Field(min_length=1, max_length=MAX_FIELD_NAME_CHARS)]


class HistoryDocBody(BaseModel):
    """One doc of a user's history, as the exported docstore holds them.

    Attributes:
        id: the doc's id, unique in the history (a number is taken as its text).
        date: when it was written, e.g. `2024-01-02`; the history is read oldest first.
        fields: the task's fields (`description`, `title`, ...), each non-empty text.
    """

    id: Annotated[Id, BeforeValidator(int_as_text)]
    date: Annotated[
        str, Field(min_length=1, max_length=MAX_DATE_CHARS, pattern=DATE, examples=["2024-01-02"])
    ]
    fields: Annotated[dict[FieldName, Text], Field(min_length=1)]


Docs = Annotated[list[HistoryDocBody], Field(min_length=1, max_length=MAX_HISTORY_DOCS)]


class _AnswersBase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _known_categories(cls, data: object) -> object:
        unknown = sorted(set(data) - set(CATEGORIES)) if isinstance(data, dict) else []
        if unknown:
            raise PydanticCustomError("unknown_category", "unknown questionnaire categories {unknown}; known: "
                                      "{known}", {"unknown": str(unknown), "known": str(list(CATEGORIES))})
        return data


# one optional text per category of the sign-up questionnaire (memory/extract.py), none other
Answers = create_model("Answers", __base__=_AnswersBase, __doc__="Answers to the sign-up questionnaire.",
                       **{category: (Text, None) for category in CATEGORIES})


class SignUp(BaseModel):
    """POST /v1/users: a new account, its first memories (the answers) and, optionally, a history.

    Attributes:
        user_id: the new user's id.
        answers: questionnaire category → answer; at least one, unless a history is given.
        share: whether similar users' prompts may quote this user's docs.
        history: the user's docs, encoded at once (at most MAX_HISTORY_DOCS; more is a 413).
    """

    user_id: UserId
    answers: Answers = Field(default_factory=Answers)
    share: Annotated[bool, Field(strict=True)] = True
    history: Docs | None = None

    @model_validator(mode="after")
    def _something_to_remember(self) -> SignUp:
        if not self.answers.model_fields_set and self.history is None:
            raise PydanticCustomError(
                "no_answers", "field `answers` must answer at least one questionnaire category"
            )
        return self

    def answer_texts(self) -> dict[str, str]:
        """The answers given, category → text."""
        return self.answers.model_dump(include=self.answers.model_fields_set)

    def docs(self) -> list[dict] | None:
        return None if self.history is None else [d.model_dump() for d in self.history]


class Message(BaseModel):
    """One turn of an OpenAI-style conversation.

    Attributes:
        role: who said it.
        content: what was said; earlier turns enter the prompt too.
    """

    role: Literal["system", "user", "assistant"]
    content: Annotated[str, Field(max_length=MAX_MESSAGE_CHARS)]


class Chat(BaseModel):
    """POST /v1/chat/completions: OpenAI's chat body; the last message is the user's turn.

    Attributes:
        messages: the conversation, oldest first, ending with the user's non-empty message.
        session_id: the session the turn is logged under.
        model: the model name echoed in the answer (default: the server's).
        stream: only false; streaming is not supported.
    """

    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    session_id: Id = "default"
    model: Annotated[str, Field(max_length=MAX_MODEL_CHARS)] | None = None
    stream: Annotated[bool | None, Field(strict=True, json_schema_extra={"enum": [False, None]}),
                      AfterValidator(no_streaming)] = None

    @model_validator(mode="after")
    def _ends_with_the_user(self) -> Chat:
        if self.messages[-1].role != "user":
            raise PydanticCustomError("last_message", "the last of `messages` must be the user's")
        if not self.messages[-1].content.strip():
            raise PydanticCustomError("empty_message", "messages[-1].content is empty")
        return self


class Question(BaseModel):
    """POST /v1/answers: a question of the run's task, answered by the pipeline's reader (a label of
    the task, on a label task) over the caller's CFRAG docs.

    Attributes:
        input: the task input as LaMP writes it (e.g. "Which tag does this movie relate to among the
            following tags? ... description: ...").
    """

    input: Text


class History(BaseModel):
    """POST /v1/users/{user_id}/history: a user's history, replaced whole.

    Attributes:
        history: the new docs (at most MAX_HISTORY_DOCS; more is a 413).
    """

    history: Docs

    def docs(self) -> list[dict]:
        return [d.model_dump() for d in self.history]


class ErrorDetail(BaseModel):
    message: str
    status: int


class Error(BaseModel):
    """Every refusal: a 4xx whose one-line message names the field at fault.

    Attributes:
        error: the message and the status again.
    """

    error: ErrorDetail
