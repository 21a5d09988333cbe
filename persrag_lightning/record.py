"""A run's record, `<run>/pipeline.json`, as serving reads it: what the main job chose on dev for the
reference row of its table (the docs' order, who reads, how label scores become an answer), so that
`CFRAGPipeline.from_pretrained` serves what the table reports. `pipeline/execution.py` writes the
record; this is the one place it is read back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from persrag_lightning.reading.decision import CALIBRATIONS, check_reading
from persrag_lightning.runtime import GemmChoice
from persrag_lightning.stages import SPLIT_RERANKER, Key
from persrag_lightning.utils import ConfigError

__all__ = ["CONFIGURATIONS", "RECORD", "Configuration", "Reference", "read_reference"]

RECORD = "pipeline.json"  # beside the run's bundles


@dataclass(frozen=True)
class Configuration:
    """How CFRAG serves one of the dev choice's configurations (a row of evaluate_cfrag.yaml).

    Args:
        reranker: the reranker bundle that orders the docs; None: the first-stage order.
        m: the similar users (None: CFRAG's own, the paper's); 1 is the asker alone.
        neighbour_slots: the neighbour gate: at most this many of the k docs neighbours' (None: no gate).
    """

    reranker: str | None
    m: int | None = None
    neighbour_slots: int | None = None


# the configurations the dev choice compares (pipeline/choice.py's EVERY_CANDIDATE), as their rows of
# evaluate_cfrag.yaml set them (tests/serving/test_serving_record.py holds the two together)
CONFIGURATIONS = {
    "CFRAG": Configuration("reranker"),
    "w/o reranker tuning": Configuration(None),
    "CFRAG, ≤ 2 neighbour docs": Configuration("reranker", neighbour_slots=2),
    "w/o reranker tuning, ≤ 2 neighbour docs": Configuration(None, neighbour_slots=2),
    "w/o user retrieval": Configuration("reranker", m=1),
    "w/o user retrieval (first-stage order)": Configuration(None, m=1),
    "CFRAG (split reranker)": Configuration(SPLIT_RERANKER),
    "CFRAG (split reranker), ≤ 2 neighbour docs": Configuration(SPLIT_RERANKER, neighbour_slots=2),
    "w/o user retrieval (split reranker)": Configuration(SPLIT_RERANKER, m=1),
}
READERS = {"llm": "llm", "trained": "reader"}  # the record's reader → the pipeline's reader (the bundle's name)
ANSWER_MODES = ("choose", "generate")
TABLE = "test table"  # the purpose of the evaluation that reported the reference row


@dataclass(frozen=True)
class Reference:
    """What a run's record says its reference row served.

    Args:
        path: the record file.
        row: the reference row as the table names it (e.g. "CFRAG (judgments, first-stage order)").
        configuration: how CFRAG retrieved for it (the docs' order, m, the neighbour gate).
        reader: `llm`, or `reader` (the run's trained reader bundle).
        answer_mode: how the LLM reader answered (`choose`, `generate`); None: not recorded.
        calibration: the LLM reader's label calibration; None: not recorded.
        decision: the answer taken from label scores (`auto` or a rule); None: not recorded.
        task: the run's task.
        gemm: the float32 GEMM paths the run computed with, as `PERSRAG_GEMM` pins them (`runtime.py`);
            None: not recorded.
    """

    path: Path
    row: str
    configuration: Configuration
    reader: str
    answer_mode: str | None
    calibration: str | None
    decision: str | None
    task: str
    gemm: str | None = None


def _field(record: dict, name: str, path: Path, allowed: Any = None, optional: bool = False) -> Any:
    """`record[name]`, a string, refused with a ConfigError naming the file and the field when it is
    missing (unless `optional`, which also admits null) or not one of `allowed`."""
    if name not in record:
        if optional:
            return None
        raise ConfigError(f"{path}: field {name!r} is missing; the record of `python train.py pipeline` has it")
    value = record[name]
    if optional and value is None:
        return None
    if not isinstance(value, str) or (allowed is not None and value not in allowed):
        known = f"one of {', '.join(map(str, allowed))}" if allowed is not None else "a name"
        raise ConfigError(f"{path}: field {name!r} is {value!r}, not {known}")
    return value


def _reading(record: dict, path: Path) -> dict:
    """How the reference row's LLM read label scores: the table evaluation's overrides (`evaluations`),
    the calibration chosen on dev where the table names none."""
    tables = [e for e in record.get("evaluations") or [] if isinstance(e, dict) and e.get("purpose") == TABLE]
    overrides = tables[-1].get("overrides", {}) if tables else {}
    if not isinstance(overrides, dict):
        raise ConfigError(f"{path}: field 'evaluations' ({TABLE}): 'overrides' is not an object")
    said = {k.removeprefix(Key.LLM): v for k, v in overrides.items() if k.startswith(Key.LLM)}
    said.setdefault("calibration", record.get("calibration_chosen_on_dev"))
    checks = {"answer_mode": ANSWER_MODES, "calibration": CALIBRATIONS, "decision": None}
    reading = {k: _field(said, k, path, allowed, optional=True) for k, allowed in checks.items()}
    try:  # a rule by name, or a fitted `quantile:<level>`: the one check every reader's decision goes through
        check_reading("none", reading["decision"] or "auto")
    except ValueError as e:
        raise ConfigError(f"{path}: field 'decision': {e}") from None
    return reading


def _gemm(record: dict, path: Path) -> str | None:
    """The record's float32 GEMM paths as a pin: its `gemm.chosen` (every record that measured them has
    it, the pin came later), refused naming the field where it is not an object of path names."""
    gemm = record.get("gemm")
    if gemm is None:
        return None
    chosen = gemm.get("chosen") if isinstance(gemm, dict) else None
    if not isinstance(chosen, dict) or not chosen or not all(isinstance(v, str) for v in chosen.values()):
        raise ConfigError(f"{path}: field 'gemm': 'chosen' is not an object of consumers' path names")
    return GemmChoice(0, {}, chosen).pin()


def read_reference(run_dir: str | Path) -> Reference | None:
    """The reference configuration `<run_dir>/pipeline.json` records; None for a run without one (its
    stages trained alone). A record that is not JSON or lacks a field serving reads is refused with a
    ConfigError naming the file and the field.

    Args:
        run_dir: the run's folder, `<export_root>/<run_name>`.
    """
    path = Path(run_dir) / RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not JSON ({e})") from e
    if not isinstance(record, dict):
        raise ConfigError(f"{path}: not a JSON object")
    chosen = _field(record, "chosen_on_dev", path, CONFIGURATIONS)
    reader = _field(record, "reader", path, READERS)
    task = _field(record, "task", path)
    reading = _reading(record, path)
    row = record.get("reference_row") or chosen
    return Reference(path, str(row), CONFIGURATIONS[chosen], READERS[reader], reading["answer_mode"],
                     reading["calibration"], reading["decision"], task, _gemm(record, path))
