"""Run PBR's variants on a PersonaBench community under the benchmark's protocol and write the
table.

Outputs (in `out_dir`): `results.json` (per question and variant: retrieved segment ids, R@5, N@5,
fusion weights, pseudo-feedback sizes), `summary.json`, `table.md` and `table.png` (R@5 / N@5 per
variant with 95 % bootstrap intervals over questions, LLM calls per query, wall time cold and warm).
Function API, and the evaluator a config names by class_path (`PersonaBenchEvaluation`), which calls
`run_personabench`.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from persrag_lightning.data.personabench import PersonaBenchCommunity, PersonaQuestion, load_personabench
from persrag_lightning.evaluation.base import EvaluationReport, Evaluator
from persrag_lightning.evaluation.personabench_metrics import personabench_scores
from persrag_lightning.evaluation.stats import bootstrap_interval, sign_flip_test
from persrag_lightning.retrieval.base import Strategy
from persrag_lightning.retrieval.llm_cache import CachedLLM
from persrag_lightning.retrieval.pbr import VARIANTS, Encode, PBRRetriever, PBRSettings, PseudoFeedback
from persrag_lightning.utils import atomic_write_json, atomic_write_text

__all__ = ["PersonaBenchEvalConfig", "PersonaBenchEvaluation", "PersonaBenchReport",
           "config_from_dict", "evaluate_variants", "run_personabench"]


@dataclass
class PersonaBenchEvalConfig:
    """What `persrag evaluate --config configs/evaluate_personabench.yaml` sets (section
    `evaluation`'s init_args).

    Args:
        data_dir: a PersonaBench community folder (layout in the data README).
        noise: the benchmark's noise level of the community's data, as its file names spell it
            (`0.0` = none).
        variants: PBR's variants to run (pbr.VARIANTS: PBR, PBR w/o P-PRF, PBR w/o P-Anchor, Base).
        encoder: the text encoder of questions and history segments (`minilm`, any Hugging Face name
            or folder).
        max_length: the encoder's token limit per text.
        llm_backend: the backend of P-PRF's LLM (`hf`, `llamacpp`, ...).
        llm_model: P-PRF's LLM (`smollm2`, any Hugging Face name or folder).
        llm_batch_size: prompts per LLM call.
        llm_threads: CPU threads of a local backend (hf: num_threads, llamacpp: n_threads); None:
            its default.
        llm_context: llamacpp's context window (n_ctx); None: the backend's default.
        llm_weights: llamacpp's weights (gguf = the shipped file, f16, bf16, ...); None: the
            default.
        cache_dir: where the LLM's answers are cached.
        out_dir: where results.json, summary.json and the table are written.
        max_questions_per_person: cap on questions per person, the first in file order (None = all).
        warm_rerun: run each variant a second time with every cache filled, to time it warm.
        bootstrap_samples: resamples of the 95 % bootstrap intervals over questions.
        seed: seed of the bootstrap intervals.
        pbr: PBR's knobs (the paper's PersonaBench settings); each variant sets its switches.
    """

    data_dir: str = "../shared/data/personabench/community_0"
    noise: str = "0.0"
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    encoder: str = "minilm"
    max_length: int = 256
    llm_backend: str = "hf"
    llm_model: str = "smollm2"
    llm_batch_size: int = 8
    llm_threads: int | None = None
    llm_context: int | None = None
    llm_weights: str | None = None
    cache_dir: str = ".cache/pbr"
    out_dir: str = "outputs/personabench"
    max_questions_per_person: int | None = None
    warm_rerun: bool = True
    bootstrap_samples: int = 1000
    seed: int = 0
    pbr: PBRSettings = field(default_factory=PBRSettings)


@dataclass(frozen=True)
class QuestionResult:
    """One question under one variant."""

    variant: str
    q_id: str
    person: str
    category: str
    question: str
    retrieved: list[str]
    gt_alternatives: list[list[str]]
    recall: float
    ndcg: float
    w1: float
    w2: float
    num_utterances: int
    reasoning_chars: int
    utterances_json: bool
    # of the pseudo-utterances + reasoning: equal digests = query-independent feedback
    feedback_digest: str


@dataclass(frozen=True)
class VariantSummary:
    """A row of the table."""

    variant: str
    questions: int
    recall: float
    recall_ci: tuple[float, float]
    ndcg: float
    ndcg_ci: tuple[float, float]
    llm_calls_per_query: float
    cold_seconds: float
    warm_seconds: float | None
    warm_llm_calls: int | None
    pagerank_ms_per_user: float | None
    prf_json_rate: float | None = None  # share of utterance answers that were JSON candidates
    # distinct pseudo-feedback texts / questions (1.0 = all different)
    prf_distinct_rate: float | None = None
    # utterances decoded under the JSON schema (None: no P-PRF)
    prf_json_constrained: bool | None = None
    pagerank_not_converged: int = 0  # anchors whose power iteration stopped at max_iter above tol
    # the largest last-step L1 change over the anchors built
    pagerank_max_residual: float | None = None


@dataclass
class PersonaBenchReport:
    """Everything a run measured; `markdown()` is the table docs/pbr_personabench.md shows."""

    data_dir: str
    encoder: str
    llm: str
    settings: PBRSettings
    index_seconds: float
    summaries: list[VariantSummary]
    results: list[QuestionResult]

    def markdown(self) -> str:
        n = self.summaries[0].questions if self.summaries else 0
        lines = [
            f"PersonaBench `{Path(self.data_dir).name}`, encoder `{self.encoder}`, LLM `{self.llm}`; "
            + f"{n} questions; 95 % bootstrap CI over questions.",
            "",
            "| variant | R@5 | 95 % CI | N@5 | 95 % CI | LLM calls / query | cold s | warm s | PageRank ms / user |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for s in self.summaries:
            warm = "-" if s.warm_seconds is None else f"{s.warm_seconds:.1f}"
            pr = "-" if s.pagerank_ms_per_user is None else f"{s.pagerank_ms_per_user:.2f}"
            lines.append(
                f"| {s.variant} | {s.recall:.4f} | {s.recall_ci[0]:.3f}–{s.recall_ci[1]:.3f} | "
                f"{s.ndcg:.4f} | {s.ndcg_ci[0]:.3f}–{s.ndcg_ci[1]:.3f} | {s.llm_calls_per_query:.2f} | "
                f"{s.cold_seconds:.1f} | {warm} | {pr} |"
            )
        st = self.settings
        notes = []
        for s in self.summaries:
            if s.prf_json_rate is not None:
                how = (
                    "constrained to the JSON schema" if s.prf_json_constrained else "decoded freely"
                )
                notes.append(f"- {s.variant}: {100 * s.prf_json_rate:.0f} % of utterance answers parsed as JSON "
                             f"candidates ({how}; else raw-text fallback); distinct pseudo-feedback per question "
                             f"{100 * (s.prf_distinct_rate or 0):.0f} %.")
            if s.pagerank_not_converged:
                notes.append(f"- {s.variant}: PageRank did not converge for {s.pagerank_not_converged} anchor(s) "
                             f"within max_iter={self.settings.max_iter} (largest residual "
                             f"{s.pagerank_max_residual:.3g} > tol {self.settings.tol:g}).")
        settings = (
            f"Settings: k1={st.k1}, m={st.max_utterances}, θ={st.theta}, k2={st.k2} "
            f"(self {'in' if st.self_in_top_k2 else 'besides'} top-k2), α={st.damping}, "
            f"max_iter={st.max_iter}, tol={st.tol}, top_k={st.top_k}, json_schema={st.json_schema}, "
            f"history_chars={st.history_chars}, "
            f"utterance_tokens={st.utterance_tokens}, reasoning_tokens={st.reasoning_tokens}; "
            f"embedding all documents took {self.index_seconds:.1f} s."
        )
        notes += self.paired_lines()
        lines += ["", *notes, "", settings] if notes else ["", settings]
        return "\n".join(lines) + "\n"

    def paired_lines(self, reference: str = "Base") -> list[str]:
        """Each variant against `reference` on the same questions: the mean R@5 difference, how many
        questions went up and down, and a two-sided paired sign-flip randomisation p.

        Args:
            reference: the variant every other one is compared to.
        """
        per: dict[str, dict[str, float]] = {}
        for r in self.results:
            per.setdefault(r.variant, {})[r.q_id] = r.recall
        if reference not in per:
            return []
        out = []
        for variant, recall in per.items():
            shared = sorted(set(recall) & set(per[reference]))
            if variant == reference or not shared:
                continue
            d = np.array([recall[q] - per[reference][q] for q in shared])
            out.append(f"- {variant} vs {reference}, paired over {len(shared)} questions: R@5 {d.mean():+.4f} "
                       f"({int((d > 0).sum())} up, {int((d < 0).sum())} down; sign-flip p = {sign_flip_test(d):.4f}).")
        return out

    @classmethod
    def load(cls, out_dir: str | Path) -> PersonaBenchReport:
        """The report `write` left in `out_dir` (summary.json, results.json), to write its table
        again.

        Args:
            out_dir: the folder `write` wrote.
        """
        out = Path(out_dir)
        summary = json.loads((out / "summary.json").read_text())
        results = [QuestionResult(**r) for r in json.loads((out / "results.json").read_text())]
        variants = [VariantSummary(**{**v, "recall_ci": tuple(v["recall_ci"]), "ndcg_ci": tuple(v["ndcg_ci"])})
                    for v in summary["variants"]]
        return cls(summary["data_dir"], summary["encoder"], summary["llm"], PBRSettings(**summary["settings"]),
                   summary["index_seconds"], variants, results)

    def plot(self, path: str | Path) -> Path:
        """Bar chart of R@5 and N@5 per variant with the bootstrap intervals as error bars.

        Args:
            path: the PNG to write.
        """
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = [s.variant for s in self.summaries]
        x = np.arange(len(names))
        fig, ax = plt.subplots(figsize=(1.8 * len(names) + 2, 3.6))
        for offset, label, vals, cis in (
                (-0.2, "R@5", [s.recall for s in self.summaries], [s.recall_ci for s in self.summaries]),
                (0.2, "N@5", [s.ndcg for s in self.summaries], [s.ndcg_ci for s in self.summaries])):
            err = np.array([[v - lo for v, (lo, _) in zip(vals, cis)], [hi - v for v, (_, hi) in zip(vals, cis)]])
            ax.bar(x + offset, vals, 0.4, yerr=err, capsize=3, label=label)
        ax.set_xticks(x, names)
        ax.set_ylim(0, 1)
        ax.set_title(f"PersonaBench {Path(self.data_dir).name} ({self.llm})")
        ax.legend()
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    def write(self, out_dir: str | Path) -> Path:
        out = Path(out_dir)
        atomic_write_json(out / "results.json", [asdict(r) for r in self.results])
        atomic_write_json(out / "summary.json", {"data_dir": self.data_dir, "encoder": self.encoder,
                                                 "llm": self.llm, "settings": asdict(self.settings),
                                                 "index_seconds": self.index_seconds,
                                                 "variants": [asdict(s) for s in self.summaries]})
        atomic_write_text(out / "table.md", self.markdown())
        self.plot(out / "table.png")
        return out


def _interval(values: list[float], config: PersonaBenchEvalConfig) -> tuple[float, float]:
    """95 % bootstrap interval of the mean over questions; NaNs when no question was asked."""
    return bootstrap_interval(values, config.bootstrap_samples, seed=config.seed) if values else (math.nan, math.nan)


def _select_questions(
    community: PersonaBenchCommunity, per_person: int | None
) -> dict[str, list[PersonaQuestion]]:
    """Each person's questions in file order, the first `per_person` of them when capped."""
    return {p.name: list(p.questions if per_person is None else p.questions[:per_person])
            for p in community.people}


def build_index(community: PersonaBenchCommunity, encode: Encode, settings: PBRSettings,
                llm: CachedLLM | None) -> PBRRetriever:
    """Embed every person's documents once; variants reuse the indexes via `with_settings`.

    Args:
        community: the PersonaBench community whose documents are indexed.
        encode: the text encoder.
        settings: the PBR settings the returned index takes (a variant swaps them by
            `with_settings`).
        llm: the cached LLM of the variants that rewrite or summarise; None when no variant needs
            one.
    """
    base = PBRRetriever(encode, PBRSettings(use_prf=False, use_anchor=False), None)
    for person in community.people:
        base.add_user(person.name, person.texts)
    base.llm = llm
    return base.with_settings(settings)


def _run_variant(community: PersonaBenchCommunity, retriever: PBRRetriever,
                questions: dict[str, list[PersonaQuestion]]) -> list[QuestionResult]:
    """Retrieve top-k for every selected question of every person and score it by the benchmark's
    metric."""
    out = []
    k = retriever.settings.top_k
    for person in community.people:
        qs = questions[person.name]
        if not qs:
            continue
        rankings = retriever.retrieve(person.name, [q.question for q in qs], k)
        ids = person.segment_ids
        for q, r in zip(qs, rankings):
            retrieved = [ids[i] for i in r.indices]
            recall, ndcg = personabench_scores(retrieved, q.gt_alternatives, k)
            fb = r.feedback
            out.append(QuestionResult(retriever.settings.variant, q.q_id, q.person, q.category, q.question,
                                      retrieved, [list(a) for a in q.gt_alternatives], recall, ndcg, r.w1, r.w2,
                                      0 if fb is None else len(fb.utterances),
                                      0 if fb is None else len(fb.reasoning),
                                      fb is not None and fb.parsed_json, _digest(fb)))
    return out


def _digest(fb: PseudoFeedback | None) -> str:
    if fb is None:
        return ""
    return hashlib.sha256(json.dumps([fb.utterances, fb.reasoning]).encode()).hexdigest()[:12]


def _fresh(retriever: PBRRetriever, settings: PBRSettings) -> PBRRetriever:
    """A view with its own anchor memo and counters (so a cold run really builds its anchors)."""
    other = PBRRetriever(retriever.encode, settings, retriever.llm, retriever.anchor_dir)
    other.users = retriever.users
    return other


def evaluate_variants(community: PersonaBenchCommunity, encode: Encode, config: PersonaBenchEvalConfig,
                      llm: CachedLLM | None = None, llm_name: str = "none") -> PersonaBenchReport:
    """The measurement loop, independent of how the encoder and the LLM were built (tests pass
    fakes)."""
    questions = _select_questions(community, config.max_questions_per_person)
    n_questions = sum(len(v) for v in questions.values())
    t0 = time.perf_counter()
    shared = build_index(community, encode, config.pbr.for_variant("Base"), llm)
    index_seconds = time.perf_counter() - t0
    summaries, results = [], []
    for name in config.variants:
        settings = config.pbr.for_variant(name)
        cold = _fresh(shared, settings)
        t0 = time.perf_counter()
        rows = _run_variant(community, cold, questions)
        cold_seconds = time.perf_counter() - t0
        warm_seconds = warm_calls = None
        if config.warm_rerun:
            warm = _fresh(shared, settings)
            # warm = every cache filled: LLM answers on disk, anchors in memory
            warm._anchors = cold._anchors
            t0 = time.perf_counter()
            _run_variant(community, warm, questions)
            warm_seconds, warm_calls = time.perf_counter() - t0, warm.stats.llm_calls
        recalls = [r.recall for r in rows]
        ndcgs = [r.ndcg for r in rows]
        pr = cold.stats.pagerank_seconds
        summaries.append(VariantSummary(
            name, len(rows), float(np.mean(recalls)) if rows else math.nan,
            _interval(recalls, config), float(np.mean(ndcgs)) if rows else math.nan, _interval(ndcgs, config),
            cold.stats.llm_calls / max(n_questions, 1), cold_seconds, warm_seconds, warm_calls,
            1000 * float(np.mean(pr)) if pr else None,
            float(np.mean([r.utterances_json for r in rows])) if settings.use_prf and rows else None,
            len({r.feedback_digest for r in rows}) / len(rows) if settings.use_prf and rows else None,
            cold.json_constrained if settings.use_prf else None,
            cold.stats.pagerank_not_converged,
            max(cold.stats.pagerank_residuals) if cold.stats.pagerank_residuals else None))
        results.extend(rows)
    return PersonaBenchReport(
        str(community.root), config.encoder, llm_name, config.pbr, index_seconds, summaries, results
    )


def config_from_dict(section: dict[str, object]) -> PersonaBenchEvalConfig:
    """The YAML `evaluation` section's init_args (plain mapping, `pbr` nested) as a typed config;
    unknown keys are errors.

    Args:
        section: the `evaluation` section's init_args.
    """
    values = dict(section)
    pbr = values.pop("pbr", None) or {}
    if not isinstance(pbr, dict):
        raise TypeError(f"evaluation.pbr must be a mapping, got {type(pbr).__name__}")
    return PersonaBenchEvalConfig(**values, pbr=PBRSettings(**pbr))  # type: ignore[arg-type]


def run_personabench(config: PersonaBenchEvalConfig) -> PersonaBenchReport:
    """Load the community, the encoder and (when a variant needs it) the cached LLM; evaluate;
    write; return.

    Args:
        config: the evaluation's settings (data, variants, encoder, LLM, out_dir).
    """
    import torch

    from persrag_lightning.models.text_encoder import TextEncoder

    community = load_personabench(config.data_dir, config.noise)
    encoder = TextEncoder.from_pretrained(config.encoder, max_length=config.max_length)

    def encode(texts: list[str]) -> np.ndarray:
        return encoder.encode(texts).numpy().astype(np.float32)

    llm = None
    llm_name = "none"
    if any(config.pbr.for_variant(v).use_prf for v in config.variants):
        from persrag_lightning.llm.registry import load_llm

        kwargs: dict[str, object] = {"batch_size": config.llm_batch_size}
        if config.llm_threads is not None and config.llm_backend in ("hf", "llamacpp"):
            kwargs["num_threads" if config.llm_backend == "hf" else "n_threads"] = (
                config.llm_threads
            )
        if config.llm_context is not None and config.llm_backend == "llamacpp":
            kwargs["n_ctx"] = config.llm_context
        if config.llm_weights is not None and config.llm_backend == "llamacpp":
            kwargs["weights"] = config.llm_weights
        raw = load_llm(config.llm_backend, config.llm_model, **kwargs)
        llm = CachedLLM(raw, Path(config.cache_dir) / "llm", batch_size=config.llm_batch_size)
        llm_name = raw.fingerprint
    with torch.inference_mode():
        report = evaluate_variants(community, encode, config, llm, llm_name)
    report.write(config.out_dir)
    return report


@dataclass
class PersonaBenchEvaluation(PersonaBenchEvalConfig, Evaluator):
    """PBR's variants on a PersonaBench community as an evaluator
    (configs/evaluate_personabench.yaml)."""

    primary_metric = "recall@5"

    def evaluate(self, strategies: Sequence[Strategy] = ()) -> EvaluationReport:
        self.refuse_strategies(strategies, "evaluation.variants")
        report = run_personabench(self)
        results = {s.variant: {"recall@5": s.recall, "ndcg@5": s.ndcg} for s in report.summaries}
        return EvaluationReport(self.primary_metric, self.greater_is_better, report.markdown(), results,
                                Path(self.out_dir))
