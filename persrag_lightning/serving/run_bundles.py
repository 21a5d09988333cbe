"""A run's exported bundles as serving loads them: CFRAG over its user encoder, retriever, reranker
(and cohort export) as the arguments and the run's record chose them (`cfrag_from_run`), and the
reader the choice names (`reader_folder`)."""

from __future__ import annotations

from pathlib import Path

from persrag_lightning.bundles import exported_bundle, require_bundle
from persrag_lightning.reading import LLM_READER
from persrag_lightning.retrieval.cfrag import CFRAG
from persrag_lightning.serving.runtimes import resolve_runtime
from persrag_lightning.serving.served import DEFAULT_RERANKER, Choice

__all__ = ["COHORTS", "cfrag_from_run", "reader_folder"]

# the cohort export of `persrag cluster` inside a run (commands/cluster.py's EXPORT)
COHORTS = "clusters"


def reader_folder(run_dir: Path, reader: str) -> str | Path:
    """The reader the record or the argument names: `llm`, a trained reader's folder, or its bundle
    inside `run_dir` (which must be exported)."""
    if reader != LLM_READER and not Path(reader).is_dir():
        return require_bundle(run_dir / reader)
    return reader


def cfrag_from_run(run_dir: Path, choice: Choice, users: str, cohort_export: str | Path | None,
                   first_cut: str | None, reranker_runtime: str, query_runtime: str, **settings) -> CFRAG:
    """CFRAG over the run's bundles as `CFRAGPipeline.from_pretrained` resolved them (its docstring
    says how).

    Args:
        run_dir: the run's folder.
        choice: the order, the similar users, the gate and the reader resolved from the arguments and
            the record (`follow_record`).
        users: `encoder`, `mean` or `cluster`.
        cohort_export: the cohort export (users="cluster"; default `run_dir`/clusters).
        first_cut: a cheaper reranker bundle that chooses the candidates the reranker scores.
        reranker_runtime: the reranker's runtime argument (`auto`: `serving_runtime`).
        query_runtime: the query encoder's runtime argument (`auto`: `serving_runtime`).
        settings: CFRAG's other settings, passed on.
    """
    if choice.m is not None:
        settings["m"] = choice.m
    settings["neighbour_slots"] = choice.neighbour_slots
    user_encoder = require_bundle(run_dir / "user_encoder")  # stage 1: every CFRAG serves from it
    if users not in ("encoder", "mean", "cluster"):
        raise ValueError(f"users must be encoder, mean or cluster, got {users!r}")
    if users == "cluster":
        export = Path(cohort_export) if cohort_export is not None else run_dir / COHORTS
        if not (export / "cohorts.json").is_file():
            raise FileNotFoundError(f"{export}: no cohort export; make it with `persrag cluster --run_name "
                                    f"{run_dir.name} --export_root {run_dir.parent}`")
        settings["cohort_export"] = str(export)
    elif cohort_export is not None:
        raise ValueError("cohort_export is read only with users='cluster'")
    reranker = choice.reranker
    # named, or the order the record chose: must exist; the default without a record: where exported
    if reranker is not None and (reranker != DEFAULT_RERANKER or choice.reranker_from_record):
        reranker = require_bundle(run_dir / reranker)
    elif reranker is not None:
        reranker = exported_bundle(run_dir, reranker)
    if first_cut is not None:
        first_cut = require_bundle(run_dir / first_cut)
    return CFRAG(user_encoder, exported_bundle(run_dir, "retriever") or "minilm", reranker, users=users,
                 first_cut=first_cut, reranker_runtime=resolve_runtime(reranker_runtime, "reranker"),
                 query_runtime=resolve_runtime(query_runtime, "query"), **settings)
