"""pipeline.json beside the run's bundles, from the resolved job and what ran: the raw record a table
of main-job times and a test of the recipe read, and serving's default (record.py reads it back)."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from persrag_lightning.hardware import bf16_is_native, bf16_verdict, describe_cpu
from persrag_lightning.models.corpus_embeddings import embedding_precision
from persrag_lightning.pipeline.execution import Ran
from persrag_lightning.pipeline.job import Job
from persrag_lightning.pipeline.plan import Plan
from persrag_lightning.reading import LLM_READER
from persrag_lightning.record import RECORD
from persrag_lightning.retrieval.strategies import resolve_reranker_runtime
from persrag_lightning.stages import Key, run_folder
from persrag_lightning.utils import atomic_write_json

__all__ = ["print_minutes", "write_record"]


def print_minutes(ran: Ran, plan: Plan, reader: str) -> None:
    """Each step's minutes, the whole job's, and the estimate made before it started."""
    print("\n".join(f"[pipeline] {s}: {t:.1f} min" for s, t in ran.minutes.items()))
    if plan.minutes_for(reader) is not None:
        print(f"[pipeline] {sum(ran.minutes.values()):.1f} min in all; estimated {plan.minutes_for(reader):.1f} "
              f"before it started (with the {'LLM' if reader == LLM_READER else 'trained reader'} reading)")


def write_record(job: Job, ran: Ran, plan: Plan, call: dict[str, Any], decisions: dict[str, Any],
                 choices: dict[str, Any]) -> None:
    """Write <run>/pipeline.json atomically.

    Args:
        job: the job under every decision made on dev.
        ran: the stages and evaluations that ran, and their minutes.
        plan: the plan and its estimate.
        call: the command line as given (`argv`, `preset`, `split`, `questions`).
        decisions: the machine's decisions made before the plan (`plan_job`).
        choices: the dev choices (`run_job`).
    """
    atomic_write_json(run_folder(job.export_root, job.run_name) / RECORD, {
        **call, "task": job.task, "judgments": job.judgments,
        "machine": describe_cpu(), "bf16_native": bf16_is_native(), "bf16_verdict": bf16_verdict(),
        "precision": job.precision,
        # precision_decisions, and gemm: the float32 GEMM path of the reader and the encoders
        **decisions,
        "feedback_labels": job.feedback_labels,
        "corpus_embeddings": embedding_precision(),
        "evaluation_reranker": resolve_reranker_runtime(job.preset.evaluate.get(Key.RERANKER_RUNTIME) or "fp32"),
        "row_names": job.names, **choices,
        "stages": [asdict(r) for r in ran.stages], "evaluations": [asdict(r) for r in ran.evaluations],
        "minutes": {s: round(t, 2) for s, t in ran.minutes.items()}, "plan": plan.record(),
        "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z")})
