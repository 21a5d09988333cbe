"""What `CFRAGPipeline.from_pretrained` serves where an argument is left to the record: the reference
configuration of the run's table, as its `pipeline.json` says the main job chose it on dev (the docs'
order, who reads, the LLM's answer mode, calibration and decision); an argument given explicitly wins.
A run without a record serves the defaults it served before records were read. `serves_line` says
what is served and why, in one line."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.reading import LLM_READER
from persrag_lightning.reading.decision import resolve_decision
from persrag_lightning.record import RECORD, Reference, read_reference
from persrag_lightning.runtime import follow_recorded

__all__ = ["RECORD_SAYS", "Choice", "follow_record", "serves_line"]

RECORD_SAYS = "record"  # an argument's default: as the run's record says (else the defaults without a record)
DEFAULT_RERANKER = "reranker"  # without a record: stage 3's order where it is exported, else the first stage's
READING = ("answer_mode", "calibration", "decision")  # the LLM config's settings a record can set


@dataclass(frozen=True)
class Choice:
    """What a pipeline serves, resolved from its arguments and the run's record.

    Args:
        reranker: the reranker bundle (a name inside the run, or a folder); None: first-stage order.
        reader: `llm`, or a trained reader's bundle (a name inside the run, or a folder).
        llm: the LLM settings, the record's reading applied where no argument set it.
        reference: the run's record (None: the run has none).
        given: what the arguments set otherwise than the record says (`order`, `m`, `gate`, `reader`,
            a reading).
        m: the similar users (None: CFRAG's own).
        neighbour_slots: the neighbour gate (None: none).
        gemm: the line saying which float32 GEMM paths serve (`runtime.follow_recorded`).
    """

    reranker: str | None
    reader: str
    llm: LLMConfig
    reference: Reference | None
    given: tuple[str, ...] = ()
    m: int | None = None
    neighbour_slots: int | None = None
    gemm: str = ""

    @property
    def reranker_from_record(self) -> bool:
        """Whether the record chose a reranked order (then its bundle must be there)."""
        return self.reference is not None and "order" not in self.given and self.reranker is not None


def _retrieval(reference: Reference | None, given: list[str], **args: object) -> dict:
    """`reranker`, `m` and `neighbour_slots`: each that is RECORD_SAYS as the record's configuration
    (without a record: DEFAULT_RERANKER, CFRAG's m, no gate), the others as given, named in `given`
    where they differ from the record."""
    recorded = reference.configuration if reference is not None else None
    defaults = {"reranker": DEFAULT_RERANKER, "m": None, "neighbour_slots": None}
    names = {"reranker": "order", "m": "m", "neighbour_slots": "gate"}
    out = {}
    for name, value in args.items():
        if value == RECORD_SAYS:
            value = getattr(recorded, name) if recorded is not None else defaults[name]
        elif recorded is not None and value != getattr(recorded, name):
            given.append(names[name])
        out[name] = value
    return out


def follow_record(run_dir: str | Path, llm: LLMConfig | None, reranker: str | None, reader: str,
                  reading: dict[str, str | None], m: int | str | None = RECORD_SAYS,
                  neighbour_slots: int | str | None = RECORD_SAYS) -> Choice:
    """The pipeline's configuration, reader and LLM settings: each argument that is RECORD_SAYS
    (`reranker`, `m`, `neighbour_slots`, `reader`) or None (`reading`) as the record says, the others
    as given. The record's float32 GEMM paths become the process's where `PERSRAG_GEMM` is unset
    (`runtime.follow_recorded`; called before any model loads, they sum as the run's table did).

    Args:
        run_dir: the run's folder (its record is `pipeline.json` there).
        llm: the LLM settings given (None: the defaults), whose reading the record's replaces.
        reranker: the reranker bundle, None (first-stage order) or RECORD_SAYS.
        reader: `llm`, a trained reader's bundle or folder, or RECORD_SAYS.
        reading: `answer_mode`, `calibration` and `decision` given (None: the record's, else `llm`'s).
        m: the similar users (None: CFRAG's own) or RECORD_SAYS.
        neighbour_slots: the neighbour gate (None: none) or RECORD_SAYS.
    """
    reference = read_reference(run_dir)
    given: list[str] = []
    retrieval = _retrieval(reference, given, reranker=reranker, m=m, neighbour_slots=neighbour_slots)
    if reader == RECORD_SAYS:
        reader = reference.reader if reference is not None else LLM_READER
    elif reference is not None and reader != reference.reader:
        given.append("reader")
    said = {}
    for name in READING:
        recorded = getattr(reference, name) if reference is not None else None
        if reading.get(name) is not None:
            said[name] = reading[name]
            given += [name] if recorded is not None and reading[name] != recorded else []
        elif recorded is not None:
            said[name] = recorded
    config = llm or LLMConfig()
    return Choice(retrieval["reranker"], reader, replace(config, **said) if said else config, reference,
                  tuple(given), retrieval["m"], retrieval["neighbour_slots"],
                  follow_recorded(reference.gemm if reference is not None else None))


def _reads(choice: Choice, task: str) -> str:
    """Who answers and by which rule, as the line says it."""
    llm = choice.llm
    if choice.reader != LLM_READER:
        who = "the trained reader" if choice.reader == "reader" else f"the trained reader {choice.reader}"
        return f"{who} (decision {resolve_decision(task, llm.decision)})"
    if llm.answer_mode != "choose":
        return f"the LLM {llm.model} (generated answers)"
    return (f"the LLM {llm.model} (choose, calibration {llm.calibration}, decision "
            f"{resolve_decision(task, llm.decision)})")


def serves_line(choice: Choice, task: str, run_dir: str | Path) -> str:
    """One line: what is served (the configuration, the docs' order, who reads by which rule) and why
    (the record, the arguments that set something else, or the defaults of a run without a record).

    Args:
        choice: the resolved choice (`follow_record`).
        task: the task served (the docstore's).
        run_dir: the run's folder.
    """
    order = ("first-stage order" if choice.reranker is None else "reranked" if choice.reranker == DEFAULT_RERANKER
             else f"reranked by {Path(choice.reranker).name}")
    ref = choice.reference
    parts = [order] + ([f"m = {choice.m}"] if choice.m is not None else [])
    parts += [f"≤ {choice.neighbour_slots} neighbour docs"] if choice.neighbour_slots is not None else []
    what = ref.row if ref is not None and not {"order", "m", "gate"} & set(choice.given) else f"CFRAG ({', '.join(parts)})"
    if ref is None:
        why = f"the defaults (no {RECORD} in {run_dir})"
    else:
        why = f"chosen on dev by {ref.path}" + (f", except {', '.join(choice.given)} (given)" if choice.given else "")
    return f"serving {what} read by {_reads(choice, task)}: {why}"
