"""LLM extraction of a one-sentence memory and five-dimension tags from a user message (seed
§3.3/§3.5), the defensive parser of its answer, and the sign-up questionnaire of the seed's five
categories (§3.6)."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from persrag_lightning.llm.base import LLM
from persrag_lightning.llm.postprocess import first_json_object
from persrag_lightning.memory.records import DIMENSIONS, Tags, Turn

__all__ = ["CATEGORIES", "QUESTIONNAIRE", "Extraction", "Extractor", "parse_extraction",
           "questionnaire_turns"]

MAX_TAGS_PER_DIMENSION = 8
MAX_TAG_CHARS = 64
MAX_MEMORY_CHARS = 500


@dataclass(frozen=True)
class Extraction:
    """What the LLM made of a message; `parsed` is False when its answer was unusable and the
    message itself became the memory (the fallback). An empty `memory` with parsed=True means:
    nothing worth remembering."""

    memory: str
    tags: Tags
    parsed: bool
    # parsed from a cut-off JSON answer (small models loop until max_new_tokens)
    repaired: bool = False


@dataclass(frozen=True)
class Question:
    """One sign-up question: the category key (as sent by clients) and the text shown to the
    user."""

    category: str
    text: str


# The seed's five categories (§3.6), one question each.
QUESTIONNAIRE: tuple[Question, ...] = (
    Question("interaction_style", "How do you like an assistant to talk to you, and what role should it take "
                                  "(tutor, colleague, critic, ...)?"),
    Question("professional_background", "What is your professional background: your field, role and "
                                        "experience?"),
    Question("learning", "What are you learning or interested in learning, and how do you study best?"),
    Question("hobbies_lifestyle", "What are your hobbies, and what is your lifestyle like?"),
    Question("goals", "What are your short-term and long-term personal goals?"),
)
CATEGORIES: tuple[str, ...] = tuple(q.category for q in QUESTIONNAIRE)

PROMPT = """You keep a memory of facts about a user. From the user's latest message (and the conversation before \
it), write ONE short sentence stating what it tells about the user, in the third person, and tags on five \
dimensions (at most 3 short tags each). Answer with JSON only, exactly these keys:
{{"memory": "<one sentence, or empty if the message tells nothing about the user>", "topics": ["..."], \
"entities": ["..."], "query_type": ["..."], "intent": ["..."], "preferences": ["..."]}}

Conversation so far:
{history}
Latest user message:
{message}
JSON:"""


def extraction_schema(max_tags: int = 3, memory_chars: int = 200, tag_chars: int = 32) -> dict:
    """The JSON the prompt asks for as a JSON schema, with bounded lengths so the whole answer fits
    the token
    budget: a backend that can constrain its decoding (llamacpp, hf with lm-format-enforcer) then
    always returns parseable JSON instead of a cut-off tag list.

    Args:
        max_tags: most tags per dimension.
        memory_chars: the longest memory text.
        tag_chars: the longest tag.
    """
    tags = {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": tag_chars},
            "maxItems": max_tags}
    return {"type": "object",
            "properties": {"memory": {"type": "string", "maxLength": memory_chars}, **{d: tags for d in DIMENSIONS}},
            "required": ["memory", *DIMENSIONS], "additionalProperties": False}


def build_prompt(message: str, history: Sequence[Turn] = ()) -> str:
    """The extraction prompt: recent turns of both roles as context, then the message.

    Args:
        message: the message a memory is extracted from.
        history: the session's recent turns, oldest first.
    """
    lines = "\n".join(f"{t.role}: {t.text}" for t in history) or "(none)"
    return PROMPT.format(history=lines, message=message)


def _tag_list(value: object) -> tuple[str, ...]:
    """A dimension's value as a tuple of short strings; accepts a list or one comma-separated
    string."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, list) else [value]
    out = [str(v).strip()[:MAX_TAG_CHARS] for v in items if isinstance(v, (str, int, float)) and str(v).strip()]
    return tuple(out[:MAX_TAGS_PER_DIMENSION])


_JSON_STRING = r'"((?:[^"\\\n]|\\.)*)"'


def _string(body: str) -> str | None:
    try:
        return json.loads(f'"{body}"')
    except json.JSONDecodeError:
        return None


def _salvage(text: str) -> dict | None:
    """Recover a cut-off answer (the usual failure of a 135M model: a tag list repeated until the
    token limit): the complete `memory` string and the complete strings of each dimension's list;
    None without a memory."""
    m = re.search(r'"memory"\s*:\s*' + _JSON_STRING, text)
    memory = _string(m.group(1)) if m else None
    if memory is None:
        return None
    obj: dict = {"memory": memory}
    for dim in DIMENSIONS:
        start = re.search(rf'"{dim}"\s*:\s*\[', text)
        if start:
            body = text[start.end():]
            items = [_string(x) for x in re.findall(_JSON_STRING, body.split("]", 1)[0])]
            obj[dim] = [x for x in items if x is not None]
    return obj


def fallback(message: str) -> Extraction:
    """The one fallback: the message itself is the memory, no tags.

    Args:
        message: the chat message, stored as it is.
    """
    return Extraction(" ".join(message.split())[:MAX_MEMORY_CHARS], Tags(), parsed=False)


def parse_extraction(answer: str, message: str) -> Extraction:
    """Parse the LLM's answer; anything that is not a JSON object with a string `memory` gives
    `fallback`.

    Args:
        answer: the LLM's answer.
        message: the message it was asked about (the fallback's memory).
    """
    obj, repaired = first_json_object(answer), False
    if obj is None:
        obj, repaired = _salvage(answer), True
    if obj is None or not isinstance(obj.get("memory"), str):
        return fallback(message)
    tag_src = obj.get("tags") if isinstance(obj.get("tags"), dict) else obj
    tags = Tags(**{d: _tag_list(tag_src.get(d)) for d in DIMENSIONS})
    return Extraction(
        " ".join(obj["memory"].split())[:MAX_MEMORY_CHARS], tags, parsed=True, repaired=repaired
    )


class Extractor:
    """Turns messages into memories with any `LLM` backend; counts the answers that needed the
    fallback."""

    def __init__(self, llm: LLM, max_new_tokens: int = 160, history_turns: int = 6,
                 json_schema: bool = False) -> None:
        """`json_schema`: constrain the answer to `extraction_schema()` where the backend can; off
        by default, as the seed parses a free answer (`MemorySettings.constrained_extraction` says
        what each gave here)."""
        self.llm = llm
        self.max_new_tokens = max_new_tokens
        self.history_turns = history_turns
        self.schema = extraction_schema() if json_schema and getattr(llm, "supports_json_schema", False) else None
        self.calls = 0
        self.fallbacks = 0
        self.repaired = 0
        self._lock = threading.Lock()

    def extract(self, message: str, history: Sequence[Turn] = ()) -> Extraction:
        return self.extract_many([message], [history])[0]

    def extract_many(
        self, messages: Sequence[str], histories: Sequence[Sequence[Turn]]
    ) -> list[Extraction]:
        """One batched LLM call for several messages (the questionnaire's answers)."""
        prompts = [build_prompt(m, list(h)[-self.history_turns:] if self.history_turns else [])
                   for m, h in zip(messages, histories, strict=True)]
        constrain = {} if self.schema is None else {"json_schema": self.schema}
        answers = self.llm.generate(prompts, self.max_new_tokens, **constrain) if prompts else []
        out = [parse_extraction(a, m) for a, m in zip(answers, messages, strict=True)]
        with self._lock:
            self.calls += len(out)
            self.fallbacks += sum(not e.parsed for e in out)
            self.repaired += sum(e.repaired for e in out)
        return out

    @property
    def fallback_rate(self) -> float:
        return self.fallbacks / self.calls if self.calls else 0.0


def questionnaire_turns(answers: Mapping[str, str]) -> list[tuple[Question, str]]:
    """Validate sign-up answers (known categories, string values) and keep the non-empty ones, in
    the questionnaire's order.

    Args:
        answers: questionnaire category → the user's answer.
    """
    unknown = sorted(set(answers) - set(CATEGORIES))
    if unknown:
        raise ValueError(f"unknown questionnaire categories {unknown}; known: {list(CATEGORIES)}")
    out = []
    for q in QUESTIONNAIRE:
        value = answers.get(q.category)
        if value is None:
            continue
        if not isinstance(value, str):
            raise TypeError(
                f"answer to {q.category!r} must be a string, got {type(value).__name__}"
            )
        if value.strip():
            out.append((q, value.strip()))
    return out
