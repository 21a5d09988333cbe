"""Where a stage's LaMP data comes from: a directory of LaMP files, or SynthLaMP generated into the
cache."""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

from persrag_lightning.data.folder_task import resolve_task
from persrag_lightning.data.lamp import load_lamp
from persrag_lightning.data.records import LampDataset
from persrag_lightning.data.synth import SynthConfig, generate_synth_lamp
from persrag_lightning.utils import fingerprint

__all__ = ["LampSource"]


class LampSource:
    """`data_dir` with LaMP files, or (when None) the embedded SynthLaMP of `synth` under
    `cache_dir`; a converted folder's task (a label task's labels) is read from its convert.json and
    must agree with `task`."""

    def __init__(self, task: str = "LaMP-2", data_dir: str | None = None, synth: SynthConfig | None = None,
                 cache_dir: str = ".cache/persrag") -> None:
        self.task = resolve_task(task, data_dir)
        self.cache_dir = Path(cache_dir)
        self.synth = None if data_dir else replace(synth or SynthConfig(), task=self.task)
        self.data_dir = Path(data_dir) if data_dir else (
            self.cache_dir / "synthlamp" / f"{self.task}-{fingerprint(asdict(self.synth))}")

    def prepare(self) -> Path:
        """Generate SynthLaMP if it is the source (idempotent); a user's data_dir must already
        exist."""
        if self.synth is not None:
            generate_synth_lamp(self.data_dir, self.synth)
        elif not self.data_dir.is_dir():
            raise FileNotFoundError(f"data_dir {self.data_dir} does not exist")
        return self.data_dir

    def load(self) -> LampDataset:
        return load_lamp(self.data_dir, self.task)
