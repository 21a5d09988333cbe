"""The request bodies of `persrag serve` (serving/requests.py): the limits their models declare are the ones the
service enforced by hand before, the OpenAPI schema carries them, and every refusal is one line naming the field.
No service, no model: the models alone."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from persrag_lightning.data.lamp import parse_date
from persrag_lightning.serving.app import body_schemas
from persrag_lightning.serving.requests import (
    MAX_HISTORY_DOCS,
    MAX_MESSAGE_CHARS,
    MAX_MESSAGES,
    Chat,
    History,
    HistoryDocBody,
    SignUp,
    Text,
)
from persrag_lightning.serving.validation import ServiceError, parse

DOC = {"id": "d1", "date": "2024-01-02", "fields": {"description": "a quiet film"}}


def accepted(adapter: TypeAdapter, value: object) -> bool:
    try:
        adapter.validate_python(value)
    except ValidationError:
        return False
    return True


def test_not_blank_means_what_str_strip_means():
    """The text pattern is Rust's regex; every whitespace character of Python's str.strip() (all below U+3001) is
    blank to it too, and no other."""
    text = TypeAdapter(Text)
    differ = [hex(cp) for cp in range(0x3001) if not 0xD800 <= cp < 0xE000
              and accepted(text, chr(cp)) != bool(chr(cp).strip())]
    assert differ == []


@pytest.mark.parametrize("date", ["2024-01-02", "2024", "1-2-3-4", "2024-13-45", "", "2024/01/02", "2024-", "-1",
                                  "２０２４", "2024-01-02\n", "x"])
def test_a_date_is_what_parse_date_reads(date):
    def reads(text: str) -> bool:
        try:
            parse_date(text)
        except ValueError:
            return False
        return True

    assert accepted(TypeAdapter(HistoryDocBody), {**DOC, "date": date}) == reads(date)


def test_the_schema_carries_the_enforced_limits():
    schemas = body_schemas()
    assert {"SignUp", "Chat", "History", "HistoryDocBody", "Message", "Answers", "Error"} <= set(schemas)
    assert schemas["History"]["properties"]["history"]["maxItems"] == MAX_HISTORY_DOCS
    assert schemas["Chat"]["properties"]["messages"]["maxItems"] == MAX_MESSAGES
    assert schemas["Message"]["properties"]["content"]["maxLength"] == MAX_MESSAGE_CHARS
    assert schemas["Answers"]["additionalProperties"] is False
    assert schemas["SignUp"]["properties"]["user_id"]["pattern"].startswith("^[^/")


@pytest.mark.parametrize(("model", "body", "status", "words"), [
    (Chat, {"messages": [{"role": "user", "content": "a" * (MAX_MESSAGE_CHARS + 1)}]}, 400,
     "field `messages[0].content` has 8001 characters, more than the limit of 8000"),
    (Chat, {"messages": [{"role": "user", "content": "hi"}], "stream": True}, 400, "streaming is not supported"),
    (Chat, {"messages": [{"role": "assistant", "content": "hi"}]}, 400, "the last of `messages` must be the user's"),
    (SignUp, {"user_id": "a/b", "answers": {"goals": "g"}}, 400, "field `user_id`"),
    (SignUp, {"user_id": "ok", "answers": {"goals": "g"}, "share": "no"}, 400, "field `share` must be true or false"),
    (SignUp, {"user_id": "ok", "answers": {"goals": "g"}, "history": [DOC] * (MAX_HISTORY_DOCS + 1)}, 413,
     f"more than the limit of {MAX_HISTORY_DOCS}"),
    (History, {"history": [{**DOC, "fields": {"x" * 65: "y"}}]}, 400, "a field name of `history[0].fields`"),
    (History, {"history": [{**DOC, "fields": {"my field": "\x1c "}}]}, 400, "field `history[0].fields['my field']`"),
    (History, [DOC], 400, "body must be a JSON object"),
])
def test_every_refusal_is_one_line_naming_the_field(model, body, status, words):
    with pytest.raises(ServiceError) as refused:
        parse(model, body)
    assert refused.value.status == status and words in refused.value.message
    assert "\n" not in refused.value.message


def test_a_numeric_doc_id_is_its_text_and_extra_fields_are_ignored():
    history = parse(History, {"history": [{**DOC, "id": 7, "source": "lamp"}], "note": "x"}).docs()
    assert history == [{**DOC, "id": "7"}]
