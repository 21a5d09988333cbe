"""Progress of a long phase on stderr, with an ETA: `[evaluate CFRAG] 120/300 prompts (40 %) (ETA
x.x min)`.

Lines, not a redrawn bar, so logs of Slurm jobs and CI stay readable; at most one line per `every`
seconds, plus the last. Printed (not logged) so it shows without logging configured, and quiet logs
(logs.py) keep it."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

__all__ = ["Progress", "eta", "in_blocks", "progress"]

T = TypeVar("T")


def eta(started: float, done: int, total: int) -> str:
    """` (ETA x.x min)`, the minutes left at the mean time of the finished items (nothing before the
    first one finishes)."""
    if done == 0:
        return ""
    left = (time.perf_counter() - started) / done * (total - done)
    return f" (ETA {left / 60:.1f} min)"


def progress(line: str) -> None:
    """One progress line on stderr."""
    print(line, file=sys.stderr, flush=True)


class Progress:
    """Counts finished items of one phase and prints `done/total` with the ETA every `every`
    seconds, and a last line with the time taken (`final="if_long"`: only after a phase that printed
    a line before, so short phases repeated many times, such as a stage's per-epoch validation, stay
    silent)."""

    def __init__(self, phase: str, total: int, unit: str = "items", every: float = 10.0,
                 final: str = "always") -> None:
        self.phase, self.total, self.unit, self.every, self.final = phase, total, unit, every, final
        self.done = 0
        self.started = self.last = time.perf_counter()

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if self.done >= self.total:
            if self.final == "always" or self.last != self.started:
                progress(f"[{self.phase}] {self.done}/{self.total} {self.unit} in {(now - self.started) / 60:.1f} min")
        elif now - self.last >= self.every:
            self.last = now
            progress(f"[{self.phase}] {self.done}/{self.total} {self.unit} ({100 * self.done / self.total:.0f} %)"
                     + eta(self.started, self.done, self.total))


def in_blocks(items: Sequence[int], compute: Callable[[list[int]], list[T]], phase: str | None,
              block: int, unit: str = "prompts", every: float = 10.0) -> list[T]:
    """`compute(items)` in consecutive blocks of `block`, with progress lines when a phase is named
    and there is more than one block (results in the order of `items`)."""
    items = list(items)
    if phase is None or len(items) <= block:
        return compute(items)
    bar = Progress(phase, len(items), unit, every)
    out: list[T] = []
    for start in range(0, len(items), block):
        part = items[start:start + block]
        out.extend(compute(part))
        bar.advance(len(part))
    return out
