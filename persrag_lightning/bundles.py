"""A run's exported bundles on disk, found or required. A bundle is exported when its folder holds `config.json`;
one that is required and missing is refused with the command that trains it (the stage graph, `stages.py`)."""

from __future__ import annotations

from pathlib import Path

from persrag_lightning.stages import STAGES, bundle_path

__all__ = ["exported_bundle", "require_bundle"]

_CONFIG = "config.json"  # what every export writes; a folder without it is not (or not yet) a bundle


def exported_bundle(run_dir: str | Path, name: str) -> str | None:
    """The path of a run's exported bundle, or None when that stage was not trained.

    Args:
        run_dir: the run's folder, `<export_root>/<run_name>`.
        name: the bundle's name (a stage of `stages.py`, or a stage exported under its own name).
    """
    path = bundle_path(run_dir, name)
    return str(path) if (path / _CONFIG).is_file() else None


def require_bundle(path: str | Path) -> str:
    """`path` when a bundle is exported there; else a FileNotFoundError naming the command that makes it.

    Args:
        path: the bundle's folder.
    """
    if (Path(path) / _CONFIG).is_file():
        return str(path)
    name = Path(path).name
    how = f"`{STAGES[name].command()}` (same --run_name)" if name in STAGES else "the stage that exports it"
    raise FileNotFoundError(f"{path} is not trained yet; make it with {how}, or all stages with "
                            "`python train.py pipeline`")
