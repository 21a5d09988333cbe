"""What a run decides about this machine before anything trains: where it computes in bfloat16 (the
precision policy of hardware.py) and which float32 GEMM path its reader and encoders take (the
runtime policy of runtime.py). The pipeline prints each decision once, before its plan, and keeps
them in pipeline.json."""

from __future__ import annotations

from typing import Any

from persrag_lightning.hardware import (
    Precision,
    auto_precision,
    bf16_is_native,
    bf16_verdict,
    describe_cpu,
    uses_bf16,
)
from persrag_lightning.models.corpus_embeddings import embedding_precision
from persrag_lightning.pipeline.rates import reader_dtype
from persrag_lightning.presets import Preset
from persrag_lightning.retrieval.strategies import resolve_reranker_runtime
from persrag_lightning.runtime import announce, gemm_choice
from persrag_lightning.stages import Key

__all__ = ["announce_decisions", "label_overrides", "precision_overrides"]


def precision_overrides(rule: Precision | str | None) -> dict[str, Any]:
    """`trainer.precision` for a stage by a preset's policy (hardware.uses_bf16); None: the
    config's.

    Args:
        rule: the preset's precision policy for the stage's kind of work (a `Precision` or its
            name); None keeps the config's precision.
    """
    return {} if rule is None else {Key.PRECISION: auto_precision(policy=rule)}


def label_overrides(rule: Precision | str | None, backend: str | None) -> dict[str, Any]:
    """The feedback LLM's dtype by a preset's rule: bfloat16 for hf where the rule says native
    (`cpu_native`: not on a GPU, where hf's `auto` dtype is bfloat16 already); nothing elsewhere, so
    the configs' `backend: auto` still picks the faster exact backend, nor under a backend without a
    dtype option.

    Args:
        rule: the preset's precision policy for the feedback labels; None adds nothing.
        backend: the feedback LLM's backend as the config or command line names it (None or `auto`
            as `hf`).
    """
    if rule is None or backend not in (None, "auto", "hf") or not uses_bf16(rule):
        return {}
    return {Key.FEEDBACK_LLM_OPTIONS: {"dtype": "bfloat16"}}


def precision_decisions(preset: Preset, backend: str | None, llm: dict) -> dict[str, str]:
    """Where this run computes in bfloat16, each kind of work once (hardware.uses_bf16 under the
    preset's policy; `llm`: the evaluation's resolved LLM settings, `rates.evaluation_llm_settings`): printed
    before the plan and kept in pipeline.json.

    Args:
        preset: the run's preset, whose precision policies decide each kind of work.
        backend: the evaluation LLM's backend (None or `auto`: the configs' choice).
        llm: the evaluation's resolved LLM settings (`rates.evaluation_llm_settings`).
    """
    rules = preset.precision
    stages = {"stage 1": rules.user_encoder, "feedback stages": rules.feedback, "generator": rules.generator}
    out = {
        k: "config's" if rule is None else auto_precision(policy=rule) for k, rule in stages.items()
    }
    out["feedback labels"] = (
        "bfloat16" if label_overrides(rules.labels, backend) else "the configs' backend (exact)"
    )
    out["reader"] = (
        reader_dtype(llm) if llm.get("backend") == "hf" else f"the {llm.get('backend')} backend's"
    )
    out["rerankers"] = resolve_reranker_runtime(
        preset.evaluate.get(Key.RERANKER_RUNTIME) or "fp32"
    )
    out["corpus embeddings"] = embedding_precision()
    return out


# Said before the plan where the preset asks for a bfloat16 reader and the CPU cannot give one:
# float32 reading is compute-bound and most of such a job, and reading fewer questions buys time
# only by losing the table's power.
FLOAT32_READER_NOTE = (
    "[pipeline] no native bfloat16 here, so the reader answers in float32, which is most of this "
    "job's time: the estimate below says how long; --questions reads fewer questions but rarely "
    "shows the table's differences (docs/getting-started.md#the-main-job)"
)


def _float32_reader_note(llm: dict) -> str | None:
    """FLOAT32_READER_NOTE where the evaluation's hf reader (`llm`: its resolved settings) would
    read in bfloat16 where native and this CPU has no native bfloat16 (on a GPU it reads in
    bfloat16).

    Args:
        llm: the evaluation's resolved LLM settings (`rates.evaluation_llm_settings`).
    """
    wants_bf16 = (llm.get("options") or {}).get("dtype") == "bf16_if_native"
    if llm.get("backend") == "hf" and wants_bf16 and reader_dtype(llm) != "bfloat16":
        return FLOAT32_READER_NOTE
    return None


def announce_decisions(preset: Preset, backend: str | None, llm: dict) -> dict[str, Any]:
    """The run's first lines: the machine and whether bfloat16 is native, the note on float32
    reading where it applies, the precision of each kind of work, then the float32 GEMM path of the
    reader and of the encoders with the rates measured here (runtime.gemm_choice, once per process).
    Returns what was said as pipeline.json keeps it: the machine, the precision decisions, the GEMM
    paths, and two of the precisions again under the keys serving and older records read
    (`corpus_embeddings`, `evaluation_reranker`).

    Args:
        preset: the run's preset (its precision policy per kind of work).
        backend: `--llm_backend` (None: the configs').
        llm: the evaluation's resolved LLM settings (`rates.evaluation_llm_settings`).
    """
    machine, verdict = describe_cpu(), bf16_verdict()
    print(f"[pipeline] {machine}; bfloat16 native: {verdict}")
    if note := _float32_reader_note(llm):
        print(note)
    decisions = precision_decisions(preset, backend, llm)
    print("[pipeline] precision: " + ", ".join(f"{k} {v}" for k, v in decisions.items()))
    choice = gemm_choice()
    announce(choice, "[pipeline]", again=True)
    if decisions["reader"] != "float32" and not choice.forced:
        print(f"[pipeline] the reader computes in {decisions['reader']} here, so the reader's float32 GEMM path serves "
              "only a reader set to float32; the encoders' serves their fp32 work")
    return {"machine": machine, "bf16_native": bf16_is_native(), "bf16_verdict": verdict,
            "precision_decisions": decisions, "gemm": choice.record(),
            "corpus_embeddings": decisions["corpus embeddings"], "evaluation_reranker": decisions["rerankers"]}
