"""The pipeline's presets: YAML files in configs/presets/ (or a user's own file), read as OmegaConf
structured configs over `Preset`, so a misspelt key, a wrong type or an unknown stage is refused in
one line that names the file and the key. A preset with `base: quick` states only what differs from
quick.yaml (an OmegaConf merge; null keeps the stage config's own value).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

from persrag_lightning.hardware import Precision
from persrag_lightning.models.user_encoder import Judgments
from persrag_lightning.reading.decision import Calibration
from persrag_lightning.stages import SPLIT_RERANKER, STAGES
from persrag_lightning.utils import ConfigError, resolve_config_path

__all__ = ["Preset", "load_preset", "preset_names"]

PRESET_DIR = "presets"
# the trained reader (the reader stage's export) and the LLM (reading/)
READERS = ("trained", "llm")


@dataclass
class Precisions:
    """A preset's precision policy (hardware.Precision) per kind of work; None keeps the stage
    config's."""

    user_encoder: Precision | None = None
    feedback: Precision | None = None
    labels: Precision | None = None     # the feedback LLM's dtype (hf only)
    generator: Precision | None = None


@dataclass
class Preset:
    """What a pipeline run trains and reports. Override keys are the stage configs' keys with typed
    values."""

    base: str | None = None
    data: dict[str, Any] = field(default_factory=dict)          # every stage
    user_encoder: dict[str, Any] = field(default_factory=dict)
    # the reader stage (configs/reader.yaml)
    reader: dict[str, Any] = field(default_factory=dict)
    # the retriever's and reranker's stages
    feedback: dict[str, Any] = field(default_factory=dict)
    # the stages distilled from stage 3's reranker (its scores are their labels, no LLM: none of `feedback`'s keys)
    distilled: dict[str, Any] = field(default_factory=dict)
    generator: dict[str, Any] = field(default_factory=dict)
    evaluate: dict[str, Any] = field(default_factory=dict)
    precision: Precisions = field(default_factory=Precisions)
    judgments: str = "none"
    # train the paper's exact chain beside a run whose stage 1 reads judgments
    paper_chain: bool = False
    select_order_on_dev: bool = False  # choose the reranked or the first-stage order on dev
    # also choose on dev the neighbour gate: every neighbour doc, at most 2 of the k, or none (own docs only)
    gate_on_dev: bool = False
    # the reranked order dev chooses among is the split reranker's (stages.SPLIT_RERANKER, distilled from stage
    # 3's), which serving computes within its budget; stage 3's exact reranker stays a reported row, not a candidate
    split_reranker: bool = False
    # label tasks: who reads (trained, llm), chosen on dev; the first wins ties
    readers: list[str] | None = None
    # the LLM reader's label calibrations the dev choices compare
    calibrations: list[str] | None = None
    stages: list[str] | None = None   # None: every stage of stages.py
    rows: list[str] | None = None     # None: every strategy of evaluate_cfrag.yaml

    def overrides(self, part: str) -> dict[str, Any]:
        """One part's overrides without its nulls (null: the stage config's own value, so no argument at all).

        Args:
            part: `data` (every stage), a kind of stage (`user_encoder`, `reader`, `feedback`, `distilled`,
                `generator`) or `evaluate`.
        """
        return {k: v for k, v in getattr(self, part).items() if v is not None}


def _preset_path(name: str) -> Path:
    """A preset by name (configs/presets/<name>.yaml) or by the path of a YAML file."""
    if name.endswith((".yaml", ".yml")) or "/" in name:
        # a file; one of the repository's configs/ is found from any folder, as `--config` names are
        path = Path(name) if Path(name).is_file() else Path(resolve_config_path(name.removeprefix("configs/")))
        if not path.is_file():
            raise ConfigError(f"--preset: no file {name}")
        return path
    path = Path(resolve_config_path(f"{PRESET_DIR}/{name}.yaml"))
    if not path.is_file():
        raise ConfigError(f"--preset: no preset {name!r}; known: {', '.join(preset_names())}, or a YAML file's path")
    return path


def preset_names() -> list[str]:
    folder = Path(resolve_config_path(f"{PRESET_DIR}/quick.yaml")).parent
    return sorted(p.stem for p in folder.glob("*.yaml"))


def load_preset(name: str, _seen: tuple[Path, ...] = ()) -> Preset:
    """The preset `name` (a name of configs/presets/ or a file), merged over its `base`, checked.

    Args:
        name: a preset of configs/presets/ (`quick`, `paper`, ...) or a YAML file's path.
        _seen: the presets this one is the base of (a `base:` cycle is refused).
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = _preset_path(name).resolve()
    if path in _seen:
        raise ConfigError(
            f"{path.name}: base: {' → '.join(p.name for p in (*_seen, path))} is a cycle"
        )
    try:
        raw = OmegaConf.load(path)
        schema = OmegaConf.structured(Preset)
        own = OmegaConf.merge(schema, raw)
        base = own.base
        merged = OmegaConf.merge(OmegaConf.structured(load_preset(base, (*_seen, path))), raw) if base else own
        preset: Preset = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        message = str(e).splitlines()[0]
        raise ConfigError(f"{path.name}: {key + ': ' if key else ''}{message}") from None
    preset.base = None
    _check_preset(preset, path)
    return preset


def _check_preset(preset: Preset, path: Path) -> None:
    """What the schema cannot say: known stages, judgments, readers and calibrations."""
    for stage in preset.stages or []:
        if stage not in STAGES:
            raise ConfigError(
                f"{path.name}: stages: unknown stage {stage!r}; known: {', '.join(STAGES)}"
            )
    if preset.split_reranker and not preset.select_order_on_dev:
        raise ConfigError(f"{path.name}: split_reranker: true needs select_order_on_dev: true (the split reranker's "
                          "order is a configuration dev chooses)")
    if preset.split_reranker and preset.stages is not None and SPLIT_RERANKER not in preset.stages:
        raise ConfigError(f"{path.name}: split_reranker: true needs the stage {SPLIT_RERANKER} in stages (after "
                          "reranker, whose scores it learns)")
    if preset.judgments not in get_args(Judgments):
        raise ConfigError(f"{path.name}: judgments: {preset.judgments!r} is not one of "
                          f"{', '.join(get_args(Judgments))}")
    for reader in preset.readers or []:
        if reader not in READERS:
            raise ConfigError(
                f"{path.name}: readers: {reader!r} is not one of {', '.join(READERS)} (the label "
                "calibrations are `calibrations`)"
            )
    for calibration in preset.calibrations or []:
        if calibration not in get_args(Calibration):
            raise ConfigError(f"{path.name}: calibrations: {calibration!r} is not one of "
                              f"{', '.join(get_args(Calibration))}")
