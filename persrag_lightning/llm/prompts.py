"""Prompt templates of the CFRAG paper (appendix, Table 4) and the token budget that fits k docs
into them.

The wording, history-item format and input format of each task are Table 4's; typographic quotes are
written as ASCII quotes and the three parts (history list, instruction, input) are separated by
newlines, one history item per line. Feedback (one candidate doc) and final generation (k docs)
share `build_prompt`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from persrag_lightning.data.records import HistoryDoc
from persrag_lightning.data.tasks import LAMP2_LABELS, get_task
from persrag_lightning.llm.profile_budget import (
    allocate_budget,
    profile_length,
    query_length,
    truncate_to_tokens,
)

__all__ = ["CHAT_MEMORY_HEADER", "DEFAULT_MAX_PROMPT_TOKENS", "PROMPT_VERSION",
           "build_chat_prompt", "build_prompt", "content_free_prompt", "domain_premise",
           "split_budget", "task_prompt", "truncate_to_tokens"]

# Bump whenever a template or the budget rule changes: it is part of every feedback / prediction
# cache key.
PROMPT_VERSION = "cfrag-table4-v1"
# Our default prompt budget (the paper gives none); callers pass their own.
DEFAULT_MAX_PROMPT_TOKENS = 512

HISTORY_HEADER = "The historical profiles are as follows:"


@dataclass(frozen=True)
class TaskPrompt:
    """One row of Table 4: instruction (with its `Based on ...` lead), input format, history-item
    format."""

    lead: str  # dropped, with the header, when no history doc is given
    instruction: str  # may hold {reference1}/{reference2} (LaMP-1)
    input_format: str  # holds {query}
    item_format: str  # holds the doc's profile fields by name
    body_field: str  # the long field of a history item, the one truncated to the budget


_PROFILES_LEAD = "Based on the historical profiles provided, "
_JSON_TITLE = (
    'Please generate it in the following format: {"title": "generated title"} without explanation, '
    "and use only English."
)

TABLE4: dict[str, TaskPrompt] = {
    "LaMP-1": TaskPrompt(
        _PROFILES_LEAD,
        "please choose one of the following two references that is more relevant to the user's input title: "
        '[1] {reference1}; [2] {reference2}. Please just answer with "[1]" or "[2]" without explanation.',
        '"title":{query}.',
        '"title":{title} "abstract":{abstract}',
        "abstract",
    ),
    "LaMP-2": TaskPrompt(
        _PROFILES_LEAD,
        f"please select the tag from [{', '.join(LAMP2_LABELS)}] that is most relevant to the user's input "
        "description. Please just answer with the tag name without explanation.",
        '"description":{query}; "tag":',
        '"description":{description}; "tag":{tag}',
        "description",
    ),
    "LaMP-3": TaskPrompt(
        _PROFILES_LEAD,
        "what is the score of the following review on a scale of 1 to 5? just answer with 1, 2, 3, 4, or 5 "
        "without further explanation.",
        '"review":{query}; "score":',
        '"review":{text} "score":{score}',
        "text",
    ),
    "LaMP-4": TaskPrompt(
        _PROFILES_LEAD,
        f"please generate a title for the given user's input text. {_JSON_TITLE}",
        '"text":{query}; "title":',
        '"text":{text} "title":{title}',
        "text",
    ),
    "LaMP-5": TaskPrompt(
        _PROFILES_LEAD,
        f"please generate a title for the given user's input abstract. {_JSON_TITLE}",
        '"abstract":{query}; "title":',
        '"abstract":{abstract} "title":{title}',
        "abstract",
    ),
    "LaMP-7": TaskPrompt(
        "Based on the style pattern of the historical tweets provided, ",
        "please paraphrase the user's input tweet without any explanation before or after it. Please generate "
        'it in the following format: {"tweet": "generated tweet"} without explanation, and use only English.',
        '"tweet":{query}.',
        '"tweet":{text}',
        "text",
    ),
}


def task_prompt(task: str) -> TaskPrompt:
    """Table 4 row of a task (any spelling `get_task` accepts); a label task of a converted folder
    gets LaMP-2's row over its own labels (`_label_prompt`)."""
    spec = get_task(task)
    return TABLE4[spec.name] if spec.name in TABLE4 else _label_prompt(spec.labels or ())


@lru_cache(maxsize=16)
def _label_prompt(labels: tuple[str, ...]) -> TaskPrompt:
    """LaMP-2's Table 4 row for a folder's own label set: the labels listed in the instruction, an
    item's text and label per history line."""
    return TaskPrompt(
        _PROFILES_LEAD,
        f"please select the label from [{', '.join(labels)}] that is most relevant to the user's input text. "
        "Please just answer with the label without explanation.",
        '"text":{query}; "label":',
        '"text":{text}; "label":{label}',
        "text",
    )


def lamp1_references(raw_input: str) -> tuple[str, str]:
    """The two candidate references of a LaMP-1 input (`... [1]: "ref one" [2]: "ref two"`)."""
    m = re.search(r'\[1\]\s*:?\s*"(.*?)"\s*\[2\]\s*:?\s*"(.*)"', raw_input, flags=re.DOTALL)
    if m is None:
        raise ValueError(
            f'LaMP-1 input has no references `[1]: "..." [2]: "..."`: {raw_input[:200]!r}'
        )
    return m.group(1).strip(), m.group(2).strip()


def split_budget(total: int, lengths: Sequence[int]) -> list[int]:
    """Tokens granted to each of k items: an even share each, a share's unused part carried to the
    next item."""
    k = len(lengths)
    if k == 0:
        return []
    total = max(0, total)
    base, extra = divmod(total, k)
    granted, carry = [], 0
    for i, need in enumerate(lengths):
        share = base + (1 if i < extra else 0) + carry
        use = min(need, share)
        granted.append(use)
        carry = share - use
    return granted


def _render(tp: TaskPrompt, items: list[str], query: str, refs: tuple[str, str] | None) -> str:
    instruction = tp.instruction
    if refs is not None:
        instruction = instruction.replace("{reference1}", refs[0]).replace("{reference2}", refs[1])
    query_line = tp.input_format.replace("{query}", query)
    if not items:
        return f"{instruction[0].upper()}{instruction[1:]}\n{query_line}"
    history = "\n".join(items)
    return f"{HISTORY_HEADER}\n{history}.\n{tp.lead}{instruction}\n{query_line}"


def render_item(tp: TaskPrompt, doc: HistoryDoc, body: str | None = None) -> str:
    """One history doc in Table 4's item format; `body` replaces the long field (after
    truncation)."""
    fields = {k: str(v) for k, v in doc.fields.items()}
    if body is not None:
        fields[tp.body_field] = body
    return re.sub(r"\{(\w+)\}", lambda m: fields.get(m.group(1), ""), tp.item_format)


def build_prompt(task: str, query_input: str, docs: list[HistoryDoc], tokenizer_len: Callable[[str], int],
                 max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS, max_query_fraction: float = 0.5,
                 profile_gamma: float | None = None) -> str:
    """Table 4 prompt for `query_input` (the raw LaMP input) with `docs` fitted into
    `max_prompt_tokens`.

    The query keeps at most `max_query_fraction` of the tokens left after the fixed text (all of
    them without docs); the rest is split evenly across the docs with carry-over, each doc's long
    field truncated to its share.

    `profile_gamma` switches to ClusterRAG's budget (seed 002, Eq. 3, llm/profile_budget.py) over
    the same tokens
    L_max (what the fixed text leaves): the query keeps min(|q|, ⌊γ·L_max⌋), the profile gets
    |U_p| = L_max − that, split as LaMP's code does (⌊|U_p| / n⌋ per doc in rank order, unused tokens carried on).
    The fixed text is taken off first so the prompt never exceeds `max_prompt_tokens` of the LLM's
    tokens.
    """
    spec = get_task(task)
    tp = task_prompt(spec.name)
    refs = lamp1_references(query_input) if spec.name == "LaMP-1" else None
    query = spec.extract_query(query_input)

    fixed = tokenizer_len(_render(tp, ["" for _ in docs], "", refs))
    available = max(0, max_prompt_tokens - fixed)
    if profile_gamma is not None and docs:
        query = truncate_to_tokens(
            query, query_length(tokenizer_len(query), available, profile_gamma), tokenizer_len
        )
        history_budget = profile_length(tokenizer_len(query), available, profile_gamma)  # Eq. 3
        allocate: Callable[[int, Sequence[int]], list[int]] = allocate_budget
    else:
        query_cap = int(available * max_query_fraction) if docs else available
        query = truncate_to_tokens(query, query_cap, tokenizer_len)
        if not docs:
            return _render(tp, [], query, refs)
        history_budget = available - tokenizer_len(query)
        allocate = split_budget

    item_fixed = [tokenizer_len(render_item(tp, d, body="")) for d in docs]
    bodies = [str(d.fields.get(tp.body_field, "")) for d in docs]
    need = [f + tokenizer_len(b) for f, b in zip(item_fixed, bodies)]
    granted = allocate(history_budget, need)
    items = [
        render_item(tp, doc, body if n <= g else truncate_to_tokens(body, g - f, tokenizer_len))
        for doc, body, n, g, f in zip(docs, bodies, need, granted, item_fixed)
    ]
    return _render(tp, items, query, refs)


# ---- open chat (the service and the memory evaluation) -------------------------------------------

CHAT_PROMPT_VERSION = "chat-memory-v1"
CHAT_MEMORY_HEADER = "What you remember about the user:"
CHAT_DOCS_HEADER = "Items from the user's history and from similar users' histories:"
CHAT_INSTRUCTION = (
    "Answer the user's last message briefly, using what you remember about them when it helps."
)


def build_chat_prompt(message: str, memories: Sequence[str], docs: Sequence[str],
                      history: Sequence[tuple[str, str]], tokenizer_len: Callable[[str], int],
                      max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS) -> str:
    """A chat prompt: recalled memories, then retrieved docs, then recent turns, then the message;
    the message keeps at most half the budget and the remaining lines share the rest (memories
    first: they are the user's)."""
    msg = truncate_to_tokens(message, max_prompt_tokens // 2, tokenizer_len)
    parts = [CHAT_INSTRUCTION]
    if memories:
        parts += [CHAT_MEMORY_HEADER, *(f"- {m}" for m in memories)]
    if docs:
        parts += [CHAT_DOCS_HEADER, *(f"- {d}" for d in docs)]
    parts += [f"{role}: {text}" for role, text in history]
    budget = max(0, max_prompt_tokens - tokenizer_len(msg) - tokenizer_len("user: \nassistant:"))
    granted = split_budget(budget, [tokenizer_len(p) + 1 for p in parts])
    kept = [p if tokenizer_len(p) + 1 <= g else truncate_to_tokens(p, g - 1, tokenizer_len)
            for p, g in zip(parts, granted)]
    return "\n".join([*(p for p in kept if p), f"user: {msg}", "assistant:"])


# ---- label calibration (llm/calibration.py) ------------------------------------------------------

def content_free_prompt(task: str, filler: str) -> str:
    """The task's Table 4 prompt without history whose input is `filler` (Zhao et al., 2021: "N/A",
    "", "[MASK]"); LaMP-1's two references are the filler too, so nothing in the prompt favours
    either."""
    spec = get_task(task)
    return _render(
        task_prompt(spec.name), [], filler, (filler, filler) if spec.name == "LaMP-1" else None
    )


def domain_premise(task: str) -> str:
    """The task's instruction alone, no history and no input: the domain premise of Holtzman et al.
    (2021)'s domain-conditional PMI, which measures how likely each label is as an answer to the
    task itself."""
    tp = task_prompt(task)
    instruction = tp.instruction.replace("{reference1}", "").replace("{reference2}", "")
    return f"{instruction[0].upper()}{instruction[1:]}"
