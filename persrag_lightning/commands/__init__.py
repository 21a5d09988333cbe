"""Subcommands of `persrag` / `train.py`; cli.py dispatches to them (arrows run cli → commands,
never back)."""

__all__ = ["cluster", "data", "evaluate", "feedback", "pipeline", "plan", "serve", "train"]  # the package's modules, imported on use
