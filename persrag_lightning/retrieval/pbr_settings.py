"""PBR's settings (seed 001): everything that changes its output, with the paper's PersonaBench
defaults, and the four variants of its evaluation as switches of them. retrieval/pbr.py runs them."""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["VARIANTS", "PBRSettings"]

VARIANTS = ("PBR", "PBR w/o P-PRF", "PBR w/o P-Anchor", "Base")


@dataclass(frozen=True)
class PBRSettings:
    """Everything that changes PBR's output. Defaults: the paper's PersonaBench settings (k1 = 5, m
    = 5, θ = 0.75, k2 = 10). Eq. 9 has a damping α but the paper gives it no value: 0.85 is
    PageRank's customary damping (Brin and Page), our choice; the authors' code has none, which
    `damping=1.0` reproduces. `self_in_top_k2=True` makes a chunk one of its own k2 neighbours (the
    authors' code); by default a row keeps its k2 nearest other chunks (Eq. 8's neighbours) plus its
    self-loop, so no row of P is empty. `json_schema` constrains the utterance answer to Eq. 5's
    `{"candidates": [...]}` where the backend can (llamacpp grammar, hf logits processor).

    Args:
        use_prf: expand the query with P-PRF, the LLM's pseudo-feedback from the user's history;
            False is the variant PBR w/o P-PRF.
        use_anchor: expand the query with P-Anchor, the PageRank anchor of the user's history; False
            is the variant PBR w/o P-Anchor.
        k1: history chunks retrieved for the P-PRF prompts (the paper's k1 = 5).
        theta: similarity threshold θ of the chunk graph's edges (Eq. 8; the paper's 0.75).
        k2: neighbours kept per chunk in the chunk graph (Eq. 8; the paper's 10).
        self_in_top_k2: count a chunk as one of its own k2 neighbours, as the authors' code does.
        damping: PageRank's damping α (Eq. 9); 0.85 is our choice (PageRank's customary value), the
            paper names α without a value and `1.0` reproduces the authors' code.
        max_iter: PageRank's iteration limit.
        tol: PageRank's convergence tolerance.
        top_k: chunks retrieved with the expanded query.
        max_utterances: utterances of the LLM's answer kept (the paper's m = 5; the prompt asks for
            10); None: every candidate written.
        json_schema: constrain the utterance answer to the JSON the prompt asks for (where
            supported).
        history_chars: cap per history chunk in the prompts (small-context LLMs); None: the whole
            chunk.
        utterance_tokens: generation limit of the utterance prompt's answer.
        reasoning_tokens: generation limit of the reasoning prompt's answer.
    """

    use_prf: bool = True
    use_anchor: bool = True
    k1: int = 5
    theta: float = 0.75
    k2: int = 10
    self_in_top_k2: bool = False
    damping: float = 0.85
    max_iter: int = 50
    tol: float = 1e-6
    top_k: int = 5
    max_utterances: int | None = 5
    json_schema: bool = True
    history_chars: int | None = None
    utterance_tokens: int = 512
    reasoning_tokens: int = 256

    def __post_init__(self) -> None:
        if self.k1 < 1 or self.k2 < 1 or self.top_k < 1:
            raise ValueError(
                f"k1, k2 and top_k must be >= 1, got {self.k1}, {self.k2}, {self.top_k}"
            )
        if not 0.0 <= self.damping <= 1.0:
            raise ValueError(f"damping must be in [0, 1], got {self.damping}")
        if self.max_utterances is not None and self.max_utterances < 1:
            raise ValueError(f"max_utterances (m) must be >= 1 or None, got {self.max_utterances}")
        if self.max_iter < 1 or self.tol <= 0:
            raise ValueError(f"max_iter must be >= 1 and tol > 0, got {self.max_iter}, {self.tol}")

    @property
    def variant(self) -> str:
        return {(True, True): "PBR", (False, True): "PBR w/o P-PRF", (True, False): "PBR w/o P-Anchor",
                (False, False): "Base"}[(self.use_prf, self.use_anchor)]

    def for_variant(self, name: str) -> PBRSettings:
        """These settings with the module switches of one of VARIANTS."""
        switches = {"PBR": (True, True), "PBR w/o P-PRF": (False, True), "PBR w/o P-Anchor": (True, False),
                    "Base": (False, False)}
        if name not in switches:
            raise ValueError(f"unknown PBR variant {name!r}; known: {', '.join(VARIANTS)}")
        use_prf, use_anchor = switches[name]
        return replace(self, use_prf=use_prf, use_anchor=use_anchor)
