"""PBR's P-PRF prompts (seed 001's appendix) and how their answers are read: the utterance and
reasoning prompts, the JSON schema that constrains the utterances where the backend can, and the
parsers of free text."""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Sequence

from persrag_lightning.retrieval.llm_cache import CachedLLM

__all__ = ["JSONSchemaLLM", "constrained_cache", "format_history", "json_candidates",
           "parse_utterances", "reasoning_prompt", "utterance_prompt", "utterance_schema"]

# Prompts copied from the seed's appendix ("Prompt Design for Our Method"); markdown emphasis
# dropped.
UTTERANCE_PROMPT = """You are to generate 10 natural candidate utterances the user might say, inspired by the dialogue \
history and the current question.

Context
- User dialogue history (for style imitation): {history}
- Current question (to inspire the utterances): {query}

Guidelines
1. Generate 10 fluent, natural utterances the user might plausibly say.
2. Do NOT just paraphrase; include variations in tone, emphasis, or context.
3. Each utterance should exceed 25 words.
4. Reflect the style and tone consistent with the document.
5. Return ONLY valid JSON in this format (no comments, no markdown):
{ "candidates": [ "...", "...", "..."] }"""

REASONING_PROMPT = """Solve the question step-by-step, inspired by the user dialogue history.

Context
- User dialogue history (for style imitation): {history}
- Current question (to inspire the reasoning): {query}

Output: step-by-step explanation that maintains user-specific tone and reasoning patterns."""

# a conservative English rate (SmolLM2's tokenizer gives ~4): sizes the schema's strings
CHARS_PER_TOKEN = 3


def utterance_schema(max_items: int | None, max_new_tokens: int) -> dict:
    """The JSON the utterance prompt asks for, `{"candidates": [str, ...]}`, as a JSON schema: one
    to `max_items` (m; 10, the prompt's count, when None) non-empty strings, each short enough that
    all of them fit in `max_new_tokens`, so a constrained answer closes its JSON instead of being
    cut off mid-string."""
    items = max_items or 10
    max_chars = max(16, CHARS_PER_TOKEN * max_new_tokens // items - 8)
    array = {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": max_chars},
             "minItems": 1, "maxItems": items}
    return {"type": "object", "properties": {"candidates": array}, "required": ["candidates"],
            "additionalProperties": False}


class JSONSchemaLLM:
    """An LLM whose `generate` is constrained to a JSON schema by its backend (llama.cpp's
    JSON-schema grammar, lm-format-enforcer's logits processor under transformers). Its fingerprint
    names the schema, so constrained and free answers never share a cache entry."""

    def __init__(self, llm: object, schema: dict) -> None:
        if not getattr(llm, "supports_json_schema", False):
            raise ValueError(
                f"LLM backend {getattr(llm, 'backend', type(llm).__name__)!r} cannot constrain its "
                "decoding to a JSON schema (hf and llamacpp can)"
            )
        self.llm, self.schema = llm, schema
        digest = hashlib.sha256(json.dumps(schema, sort_keys=True).encode()).hexdigest()[:10]
        self._fingerprint = f"{llm.fingerprint}+json-schema:{digest}"  # type: ignore[attr-defined]

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def generate(self, prompts: list[str], max_new_tokens: int) -> list[str]:
        return self.llm.generate(prompts, max_new_tokens, json_schema=self.schema)  # type: ignore[attr-defined]


def constrained_cache(llm: CachedLLM, schema: dict) -> CachedLLM | None:
    """The same prompt store around a schema-constrained view of the LLM; None when the backend
    cannot constrain (the caller then uses free decoding and says so)."""
    if not getattr(llm.llm, "supports_json_schema", False):
        return None
    other = copy.copy(llm)
    other.llm = JSONSchemaLLM(llm.llm, schema)
    other.calls = other.hits = 0
    return other


def format_history(chunks: Sequence[str], max_chars: int | None = None) -> str:
    """The {history} slot: the k1 chunks, one per line, each cut to `max_chars` when set."""
    return "\n".join(c if max_chars is None else c[:max_chars] for c in chunks)


def utterance_prompt(history: str, query: str) -> str:
    """The seed's P-PRF-roughly prompt (str.replace: the template's JSON braces are not format
    fields)."""
    return UTTERANCE_PROMPT.replace("{history}", history).replace("{query}", query)


def reasoning_prompt(history: str, query: str) -> str:
    """The seed's P-PRF-logically prompt."""
    return REASONING_PROMPT.replace("{history}", history).replace("{query}", query)


_FENCE = re.compile(r"^```[a-zA-Z]*\s*|\s*```$")


def json_candidates(text: str) -> list[str] | None:
    """The non-empty string `candidates` of a JSON answer (code fences allowed), or None if there
    are none."""
    try:
        obj = json.loads(_FENCE.sub("", text.strip()))
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("candidates"), list):
        return None
    candidates = [c.strip() for c in obj["candidates"] if isinstance(c, str) and c.strip()]
    return candidates or None


def parse_utterances(text: str, max_utterances: int | None = None) -> list[str]:
    """Eq. 5's F = {f_1..f_m}: the JSON `candidates` list; anything else (not JSON, no list, no
    strings) falls back, as the authors' code does, to the raw text as one utterance. An empty
    answer gives no utterance."""
    raw = text.strip()
    candidates = json_candidates(raw)
    if candidates is None:
        candidates = [raw] if raw else []
    return candidates if max_utterances is None else candidates[:max_utterances]
