"""ClusterRAG's prompt budget (seed 002, §4.3, Eq. 3), counted in the LLM's own tokens.

The query keeps at most ⌊γ·L_max⌋ tokens and the profile gets the rest, |U_p| = L_max − min(|q|,
⌊γ·L_max⌋); γ = 0.55 and L_max = 512 are the seed's settings (§5). The profile budget is then split
across the retrieved items as the LaMP prompt code the seed builds on does it: an equal integer
share ⌊|U_p| / n⌋ per item, items in rank order, and the tokens an item leaves unused carried over
to the next item (the remainder of the division is not handed out). Unlike `prompts.split_budget`
(CFRAG's builder), which also spreads that remainder.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["BudgetSettings", "allocate_budget", "profile_length", "query_length",
           "truncate_to_tokens"]

CountTokens = Callable[[str], int]


@dataclass(frozen=True)
class BudgetSettings:
    """The seed's prompt-length settings (§5: L_max = 512 tokens, γ = 0.55)."""

    max_prompt_tokens: int = 512  # L_max
    gamma: float = 0.55  # γ, the query's largest share of L_max


def truncate_to_tokens(text: str, budget: int, tokenizer_len: Callable[[str], int]) -> str:
    """Longest prefix of `text` (whole words when possible) with at most `budget` tokens; binary
    search."""
    if budget <= 0 or not text:
        return ""
    if tokenizer_len(text) <= budget:
        return text
    ends = [m.end() for m in re.finditer(r"\S+", text)]
    # invariant: prefix of `lo` words fits, of `hi` words does not (hi == all words)
    lo, hi = 0, len(ends)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tokenizer_len(text[:ends[mid - 1]]) <= budget:
            lo = mid
        else:
            hi = mid
    if lo > 0:
        return text[:ends[lo - 1]]
    # Not even one word fits: cut the first word by characters.
    first = text[:ends[0]] if ends else text
    lo_c, hi_c = 0, len(first)
    while hi_c - lo_c > 1:
        mid = (lo_c + hi_c) // 2
        if tokenizer_len(first[:mid]) <= budget:
            lo_c = mid
        else:
            hi_c = mid
    return first[:lo_c]


def query_length(query_tokens: int, max_prompt_tokens: int = 512, gamma: float = 0.55) -> int:
    # Eq. 3 (inner term): the query keeps min(|q|, ⌊γ·L_max⌋) tokens
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if max_prompt_tokens < 0 or query_tokens < 0:
        raise ValueError(
            f"token counts must be ≥ 0 (L_max={max_prompt_tokens}, |q|={query_tokens})"
        )
    # ⌊γ·L_max⌋ with a tolerance, so 0.55·200 = 110.00000000000001 or 109.99999999999999 floors to
    # 110
    return min(query_tokens, int(gamma * max_prompt_tokens + 1e-9))


def profile_length(query_tokens: int, max_prompt_tokens: int = 512, gamma: float = 0.55) -> int:
    # Eq. 3: |U_p| = L_max − min(|q|, ⌊γ·L_max⌋)
    return max_prompt_tokens - query_length(query_tokens, max_prompt_tokens, gamma)


def profile_budget(
    query: str, count_tokens: CountTokens, settings: BudgetSettings = BudgetSettings()
) -> int:
    """|U_p| of Eq. 3 for a query text, |q| counted by the LLM's tokenizer (`count_tokens`)."""
    return profile_length(count_tokens(query), settings.max_prompt_tokens, settings.gamma)


def allocate_budget(budget: int, lengths: Sequence[int]) -> list[int]:
    """Tokens each item (in rank order) may use: ⌊budget / n⌋ each plus what earlier items left
    unused (LaMP's carry-over); an item never gets more than it needs, so short items pass their
    share on to later ones."""
    if not lengths:
        return []
    share = max(0, budget) // len(lengths)
    granted, carry = [], 0
    for need in lengths:
        allowance = share + carry
        use = min(max(0, need), allowance)
        granted.append(use)
        carry = allowance - use
    return granted


def fit_profile(items: Sequence[str], query: str, count_tokens: CountTokens,
                settings: BudgetSettings = BudgetSettings()) -> tuple[str, list[str]]:
    """The query cut to its Eq. 3 share and each profile item cut to its allocation (whole words
    where possible): everything the task's prompt template then renders. Empty items are dropped."""
    query = truncate_to_tokens(query, query_length(count_tokens(query), settings.max_prompt_tokens,
                                                   settings.gamma), count_tokens)
    budget = profile_budget(query, count_tokens, settings)
    granted = allocate_budget(budget, [count_tokens(t) for t in items])
    fitted = [truncate_to_tokens(t, g, count_tokens) for t, g in zip(items, granted)]
    return query, [t for t in fitted if t]
