"""Turn raw LLM answers into predictions the LaMP metrics understand (labels, scores, titles,
tweets)."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence

from persrag_lightning.data.tasks import get_task

__all__ = ["default_max_new_tokens", "first_json_object", "postprocess"]

# Short budgets for label tasks keep feedback cheap; titles and tweets need a sentence.
MAX_NEW_TOKENS: dict[str, int] = {"LaMP-1": 8, "LaMP-2": 8, "LaMP-3": 8, "LaMP-4": 40, "LaMP-5": 40, "LaMP-7": 64}
# a folder's own labels ("STYLE & BEAUTY") may take more tokens than LaMP-2's tags
LABEL_TASK_TOKENS = 16
JSON_KEYS: dict[str, str] = {"LaMP-4": "title", "LaMP-5": "title", "LaMP-7": "tweet"}
_STRIP = " \t\r\n\"'`“”‘’[](){}<>.,;:!?*"


def default_max_new_tokens(task: str) -> int:
    """Per-task generation budget used by feedback and final generation unless overridden."""
    return MAX_NEW_TOKENS.get(get_task(task).name, LABEL_TASK_TOKENS)


def _strip_fences(text: str) -> str:
    return re.sub(r"```(?:json)?", "", text).strip()


def first_json_object(text: str) -> dict | None:
    """First `{...}` that parses as a JSON (or Python-literal) object: small models wrap JSON in
    prose or fences."""
    decoder = json.JSONDecoder()
    for m in re.finditer(r"\{", text):
        try:
            obj, _ = decoder.raw_decode(text, m.start())
        except json.JSONDecodeError:
            end = text.find("}", m.start())
            if end < 0:
                continue
            try:
                obj = ast.literal_eval(text[m.start():end + 1])
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                continue
        if isinstance(obj, dict):
            return obj
    return None


def extract_json_field(text: str, key: str) -> str:
    """`{"key": "..."}` value from free text: first JSON object, else a `"key": ...` pattern, else
    the first line."""
    text = _strip_fences(text or "")
    if not text:
        return ""
    obj = first_json_object(text)
    if obj is not None:
        for k, v in obj.items():
            if str(k).strip().lower() == key and isinstance(v, (str, int, float)):
                return str(v).strip()
    quoted = re.search(
        rf"""["']?{key}["']?\s*:\s*"((?:[^"\\]|\\.)*)\"""", text, flags=re.IGNORECASE
    )
    if quoted:
        try:
            return json.loads(f'"{quoted.group(1)}"').strip()
        except json.JSONDecodeError:
            return quoted.group(1).strip()
    # {"title": Unquoted words}
    bare = re.search(rf"""["']?{key}["']?\s*:\s*([^\n}}]+)""", text, flags=re.IGNORECASE)
    if bare:
        return bare.group(1).strip().strip("\"'").strip()
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return first.strip("{}").strip()


def normalize_label(text: str, labels: Sequence[str], task: str | None = None) -> str:
    """Map an answer onto the label list (case-insensitive, punctuation stripped); unknown answers
    stay as is."""
    raw = (text or "").strip()
    if task is not None and get_task(task).name == "LaMP-1":
        m = re.search(r"(?<!\d)\[?\s*([12])\s*\]?(?!\d)", raw)
        return f"[{m.group(1)}]" if m else raw
    lowered = {lab.lower(): lab for lab in labels}
    line = next((ln for ln in raw.splitlines() if ln.strip()), "")
    cleaned = re.sub(r"^\s*(?:tag|label|answer)\s*:\s*", "", line.strip(_STRIP), flags=re.IGNORECASE).strip(_STRIP).lower()
    if cleaned in lowered:
        return lowered[cleaned]
    # A label mentioned in prose: the earliest, and the longest at that position ("dark comedy" over
    # "comedy").
    best: tuple[int, int, str] | None = None
    for low, lab in lowered.items():
        m = re.search(rf"(?<![\w-]){re.escape(low)}(?![\w-])", raw.lower())
        if m and (best is None or (m.start(), -len(low)) < (best[0], -best[1])):
            best = (m.start(), len(low), lab)
    return best[2] if best else raw


def parse_score(text: str) -> str:
    """First stand-alone integer 1-5 of a LaMP-3 answer; else the raw text (the metric's unparsable
    rule applies)."""
    m = re.search(r"(?<![\d.])([1-5])(?!\d)", text or "")
    return m.group(1) if m else (text or "").strip()


def postprocess(task: str, text: str) -> str:
    """Raw LLM answer -> prediction string for the task's metric."""
    spec = get_task(task)
    if spec.name in JSON_KEYS:
        return extract_json_field(text, JSON_KEYS[spec.name])
    if spec.name == "LaMP-3":
        return parse_score(text)
    return normalize_label(text, spec.labels or (), spec.name)
